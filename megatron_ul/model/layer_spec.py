"""What a transformer layer is built from — its attention, MLP and norm modules — chosen from
the config here and nowhere else.

A spec'd module describes itself to the rest of the code base, so that nothing else keeps a
formula of it:
  - its parameters, by being built: the parameter table (pipeline/param_table.py) and the
    memory estimator's parameter counts (`held_parameters` of `described_layer`) read the
    modules of a model or a layer built on the meta device;
  - what it keeps for backward: a norm's and an MLP's `saved_bytes(ActivationShape)`, an
    MLP's `gradient_bytes`, which the estimator sums over the layer's modules.
A new norm is one Norm subclass (model/norms.py) and its name in NORMS and in
ModelConfig.normalization's choices; a new MLP variant is one MLP subclass (model/mlp.py), its
entry in MLPS and the config field that selects it in `mlp_choice`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any, cast

import torch
from torch import nn

from ..config import ModelConfig
from ..mpu.parallel_state import single_rank_dims
from ..mpu.param_init import deferred
from ..mpu.param_spec import param_spec
from .mlp import MLP, SwiGLUMLP
from .moe.layer import MoELayer
from .norms import LayerNorm, Norm, RMSNorm
from .transformer import SelfAttention, TransformerLayer

# --normalization's choices.
NORMS: dict[str, type[Norm]] = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}
MLPS: dict[str, type[MLP]] = {"gelu": MLP, "swiglu": SwiGLUMLP}


@dataclass(frozen=True)
class LayerSpec:
    attention: type[SelfAttention]
    mlp: type[MLP]
    norm: type[Norm]  # both of the layer's norms and the final norm
    moe: type[nn.Module] | None = None  # the MLP slot of MoE layers (ModelConfig.is_moe_layer)

    def mlp_for(self, cfg: ModelConfig, layer_number: int) -> type[MLP]:
        if self.moe is not None and cfg.is_moe_layer(layer_number):
            # MoELayer answers the MLP's interface (forward, saved_bytes, gradient_bytes,
            # saved_blocks, tile_tokens) without its fc1/fc2.
            return cast("type[MLP]", self.moe)
        return self.mlp

    def build_norm(self, cfg: ModelConfig, sequence_parallel: bool, device, dtype) -> Norm:
        return self.norm(
            cfg.hidden_size,
            cfg.norm_epsilon,
            sequence_parallel=sequence_parallel,
            device=device,
            dtype=dtype,
        )


def mlp_choice(cfg: ModelConfig) -> str:
    return "swiglu" if cfg.swiglu else "gelu"


def layer_spec(cfg: ModelConfig) -> LayerSpec:
    if cfg.normalization not in NORMS:
        raise ValueError(
            f"--normalization {cfg.normalization!r} is not a norm (choose from {sorted(NORMS)})"
        )
    moe = MoELayer if cfg.num_experts is not None else None
    return LayerSpec(SelfAttention, MLPS[mlp_choice(cfg)], NORMS[cfg.normalization], moe)


def described_layer(cfg: ModelConfig) -> TransformerLayer:
    """One layer built whole (TP 1) on the meta device: no memory, no communication. What the
    estimator asks for a layer's parameters and saved bytes; read it, never change it."""
    return _described_layer(_values(cfg))


def described_norm(cfg: ModelConfig) -> Norm:
    """The final norm, built like `described_layer`."""
    return _described_norm(_values(cfg))


def _values(cfg: ModelConfig) -> tuple:
    # The backend is irrelevant to the description (and flash may be unavailable here). Lists
    # (the window) become tuples, so the values can key the cache.
    return tuple(
        (f.name, _hashable(getattr(cfg, f.name))) for f in fields(cfg) if f.name != "use_flash_attn"
    )


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def _config(values: tuple) -> ModelConfig:
    restored: dict[str, Any] = {k: list(v) if isinstance(v, tuple) else v for k, v in values}
    return ModelConfig(**restored)


# A description is a pure function of the config's values; the estimator asks for one per term
# (~5 ms each), so a fit over layouts would otherwise spend seconds rebuilding the same layer.
@functools.lru_cache(maxsize=32)
def _described_layer(values: tuple) -> TransformerLayer:
    with torch.device("meta"), deferred():
        cfg = _config(values)
        return TransformerLayer(cfg, 1, 0, False, dims=single_rank_dims(), spec=layer_spec(cfg))


@functools.lru_cache(maxsize=32)
def _described_norm(values: tuple) -> Norm:
    cfg = _config(values)
    with torch.device("meta"), deferred():
        return layer_spec(cfg).build_norm(cfg, False, None, torch.float32)


def held_elements(p: torch.Tensor, tp: int) -> int:
    """Elements of a whole (TP 1) parameter that one of `tp` ranks holds."""
    return p.numel() // tp if param_spec(p).tensor_parallel else p.numel()


def held_parameters(module: nn.Module, tp: int) -> int:
    """Parameters of a whole (TP 1) module that one of `tp` ranks holds."""
    return sum(held_elements(p, tp) for p in module.parameters())


def norms_of(module: nn.Module) -> list[Norm]:
    return [m for m in module.modules() if isinstance(m, Norm)]
