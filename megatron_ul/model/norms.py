"""LayerNorm and RMSNorm: apex's fused kernels when importable on a GPU, else PyTorch."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..mpu.param_init import Constant, new_parameter

log = logging.getLogger(__name__)

try:  # optional acceleration; the PyPI package named "apex" is unrelated and has no such module
    from apex.normalization.fused_layer_norm import (fused_layer_norm_affine,  # type: ignore
                                                     fused_rms_norm_affine)
    HAVE_APEX = True
except Exception:  # noqa: BLE001 - any import failure means "not available"
    HAVE_APEX = False

_announced: set = set()


def _announce(use_apex: bool) -> None:
    """Once per distinct message: which kernels normalise, and why not apex's."""
    if use_apex:
        message = "apex fused kernels"
    elif HAVE_APEX:
        message = "PyTorch F.layer_norm / F.rms_norm (apex is installed; its fused kernels " \
                  "need a CUDA device)"
    else:
        message = "PyTorch F.layer_norm / F.rms_norm (apex is not installed)"
    if message not in _announced:
        log.info("normalization: %s", message)
        _announced.add(message)


class Norm(nn.Module):
    """LayerNorm (weight + bias) or RMSNorm (weight only) over the last dimension."""

    def __init__(self, kind: str, size: int, eps: float, *, sequence_parallel: bool = False,
                 device=None, dtype=torch.float32):
        super().__init__()
        self.kind, self.eps, self.size = kind, eps, (size,)
        self.weight = new_parameter(Constant(1.0), (size,), device=device, dtype=dtype)
        self.bias = (new_parameter(Constant(0.0), (size,), device=device, dtype=dtype)
                     if kind == "LayerNorm" else None)
        for p in self.parameters():
            # Under Megatron-SP each TP rank normalises a different sequence chunk: the
            # gradients of these replicated weights must be summed over TP.
            p.sequence_parallel = sequence_parallel
        self.use_apex = HAVE_APEX and device is not None and str(device).startswith("cuda")
        _announce(self.use_apex)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_apex:
            if self.kind == "LayerNorm":
                return fused_layer_norm_affine(x, self.weight, self.bias, self.size, self.eps)
            return fused_rms_norm_affine(x, self.weight, self.size, self.eps)
        if self.kind == "LayerNorm":
            return F.layer_norm(x, self.size, self.weight, self.bias, self.eps)
        return F.rms_norm(x, self.size, self.weight, self.eps)
