"""Megatron's initialisation methods, as layout-independent, shard-only initialisers.

Each parameter has its own stream, keyed by (seed, parameter name); mpu/param_init.py computes
any element of it from its position alone, so a rank computes only the shard it holds and the
values do not depend on the layout.
"""

from __future__ import annotations

import math

from ..mpu.param_init import Normal


def normal_init(std: float, seed: int, key: str) -> Normal:
    """N(0, std²) (Megatron's init_method_normal)."""
    return Normal(std, seed, key)


def scaled_normal_init(std: float, num_layers: int, seed: int, key: str) -> Normal:
    """Megatron's init for the output projections of residual branches: std / sqrt(2L)."""
    return Normal(std / math.sqrt(2.0 * num_layers), seed, key)
