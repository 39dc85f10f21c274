"""LayerNorm and RMSNorm: apex's fused kernels when importable on a GPU, else PyTorch.

Both keep only what their backward needs: LayerNorm's native kernel (F.layer_norm) saves its
input, the mean and the reciprocal standard deviation; RMSNorm is one autograd Function that
saves its input and the per-token reciprocal RMS. PyTorch's composite F.rms_norm instead saves
the normalised input besides the input, and its backward makes four [s, h] temporaries.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..mpu.param_init import Constant, new_parameter
from ..mpu.param_spec import set_param_spec
from .activation_shape import ActivationShape

log = logging.getLogger(__name__)

try:  # optional acceleration; the PyPI package named "apex" is unrelated and has no such module
    from apex.normalization.fused_layer_norm import (
        fused_layer_norm_affine,
        fused_rms_norm_affine,
    )

    HAVE_APEX = True
except Exception:
    HAVE_APEX = False

_announced: set = set()


def _announce(use_apex: bool) -> None:
    """Once per distinct message: which kernels normalise, and why not apex's."""
    if use_apex:
        message = "apex fused kernels"
    elif HAVE_APEX:
        message = (
            "PyTorch F.layer_norm / F.rms_norm (apex is installed; its fused kernels "
            "need a CUDA device)"
        )
    else:
        message = "PyTorch F.layer_norm / RMSNorm Function (apex is not installed)"
    if message not in _announced:
        log.info("normalization: %s", message)
        _announced.add(message)


# RMSNorm's backward runs over blocks of rows (tokens): its three fp32 [rows, h] temporaries
# stay near BACKWARD_BLOCK_ELEMENTS elements each instead of growing with the sequence (at 1M
# tokens, hidden 2048, bf16: 24 GiB unblocked), in at most BACKWARD_MAX_BLOCKS blocks (each is a
# few kernel launches on a GPU). Rows are independent; only the weight's gradient sums over
# blocks (in fp32).
BACKWARD_BLOCK_ELEMENTS = 1 << 22
BACKWARD_MAX_BLOCKS = 64


class _RMSNorm(torch.autograd.Function):
    """y = x · rsqrt(mean(x²) + eps) · w, computed in fp32 (fp64 inputs: in fp64), returned in
    x's and w's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        h = x.shape[-1]
        rows = x.numel() // h
        block = max(BACKWARD_BLOCK_ELEMENTS // h, -(-rows // BACKWARD_MAX_BLOCKS), 1)
        if block >= rows or not x.is_contiguous():
            rstd = torch.rsqrt(x.to(compute).square().mean(-1, keepdim=True).add_(eps))
            out = (x.to(compute) * rstd).mul_(weight.to(compute)).to(out_dtype)
        else:  # the same rows over blocks: fp32 temporaries bounded as in backward
            out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
            rstd = torch.empty((*x.shape[:-1], 1), dtype=compute, device=x.device)
            x_rows, out_rows, rstd_rows = x.view(rows, h), out.view(rows, h), rstd.view(rows, 1)
            w = weight.to(compute)
            for start in range(0, rows, block):
                piece = slice(start, start + block)
                x_c = x_rows[piece].to(compute)
                r = torch.rsqrt(x_c.square().mean(-1, keepdim=True).add_(eps))
                rstd_rows[piece] = r
                out_rows[piece] = (x_c * r).mul_(w)
                del x_c, r
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        need_weight = ctx.needs_input_grad[1]
        h = x.shape[-1]
        rows = x.numel() // h
        block = max(BACKWARD_BLOCK_ELEMENTS // h, -(-rows // BACKWARD_MAX_BLOCKS), 1)
        if block >= rows or not (x.is_contiguous() and grad_out.is_contiguous()):
            grad_x, grad_weight = _rms_norm_backward(x, weight, rstd, grad_out, need_weight)
        else:
            grad_x = torch.empty_like(x)
            grad_weight = torch.zeros(h, dtype=rstd.dtype, device=x.device) if need_weight else None
            x_rows, g_rows, rstd_rows = x.view(rows, h), grad_out.view(rows, h), rstd.view(rows, 1)
            out_rows = grad_x.view(rows, h)
            for start in range(0, rows, block):
                piece = slice(start, start + block)
                _, block_weight = _rms_norm_backward(
                    x_rows[piece],
                    weight,
                    rstd_rows[piece],
                    g_rows[piece],
                    need_weight,
                    out=out_rows[piece],
                )
                if grad_weight is not None:
                    grad_weight += block_weight
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_x, grad_weight, None


def _rms_norm_backward(x, weight, rstd, grad_out, need_weight: bool, out=None):
    """(grad x in x's dtype, written into `out` when given; grad weight in rstd's dtype, summed
    over every dimension but the last, or None)."""
    x_hat = x.to(rstd.dtype) * rstd  # recomputed: one temporary
    g = grad_out.to(rstd.dtype)
    grad_weight = None
    if need_weight:
        grad_weight = (g * x_hat).sum(tuple(range(g.dim() - 1)))
    g = g * weight.to(rstd.dtype)  # a new tensor: grad_out stays intact
    # dx = rstd · (g − x̂ · mean(g · x̂)), written into g's buffer.
    c = (g * x_hat).mean(-1, keepdim=True)
    grad_x = g.sub_(x_hat.mul_(c)).mul_(rstd)
    if out is not None:
        return out.copy_(grad_x), grad_weight
    return grad_x.to(x.dtype), grad_weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, saving only x and the per-token reciprocal RMS."""
    if torch.compiler.is_compiling():
        # Compiled layers differentiate the formula themselves (and fuse it): torch 2.11's
        # tracing of the Function gives wrong gradients.
        compute = torch.promote_types(x.dtype, torch.float32)
        rstd = torch.rsqrt(x.to(compute).square().mean(-1, keepdim=True) + eps)
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        return (x.to(compute) * rstd * weight.to(compute)).to(out_dtype)
    return _RMSNorm.apply(x, weight, eps)


class Norm(nn.Module):
    """What the layer spec (model/layer_spec.py) needs of a norm over the last dimension:
    built as cls(size, eps, sequence_parallel=, device=, dtype=), its parameters made in
    `create_parameters` (replicated over TP), and what it keeps for backward."""

    weight: nn.Parameter  # the sublayer after the norm runs in this dtype

    def __init__(
        self,
        size: int,
        eps: float,
        *,
        sequence_parallel: bool = False,
        device=None,
        dtype=torch.float32,
    ):
        super().__init__()
        self.eps, self.size = eps, (size,)
        self.create_parameters(size, device, dtype)
        for p in self.parameters():
            # Under Megatron-SP each TP rank normalises a different sequence chunk: the
            # gradients of these replicated weights must be summed over TP.
            set_param_spec(p, sequence_parallel=sequence_parallel)
        self.use_apex = HAVE_APEX and device is not None and str(device).startswith("cuda")
        _announce(self.use_apex)

    def create_parameters(self, size: int, device, dtype) -> None:
        self.weight = new_parameter(Constant(1.0), (size,), device=device, dtype=dtype)

    def saved_bytes(self, shape: ActivationShape) -> float:
        """Bytes kept for backward: the input (per-token statistics are negligible)."""
        return shape.norm_tokens * self.size[0] * shape.residual_bytes


class LayerNorm(Norm):
    """Weight and bias; the native kernel saves the input, the mean and the reciprocal std."""

    def create_parameters(self, size: int, device, dtype) -> None:
        super().create_parameters(size, device, dtype)
        self.bias = new_parameter(Constant(0.0), (size,), device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_apex:
            return fused_layer_norm_affine(x, self.weight, self.bias, self.size, self.eps)
        return F.layer_norm(x, self.size, self.weight, self.bias, self.eps)


class RMSNorm(Norm):
    """Weight only; saves the input and the per-token reciprocal RMS."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_apex:
            return fused_rms_norm_affine(x, self.weight, self.size, self.eps)
        return rms_norm(x, self.weight, self.eps)
