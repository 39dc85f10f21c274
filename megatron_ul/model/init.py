"""Deterministic, layout-independent parameter initialisation.

Each parameter draws from its own generator seeded by (seed, parameter name), so a parameter's
initial value does not depend on which other parameters a rank builds (TP slices, pipeline
stages) or in what order.
"""
from __future__ import annotations

import math
import zlib

import torch


def _generator(seed: int, key: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)


def normal_init(std: float, seed: int, key: str):
    """init_method for mpu layers: fills a full (unsharded) CPU weight with N(0, std²)."""
    def fill(weight: torch.Tensor) -> None:
        with torch.no_grad():
            weight.normal_(0.0, std, generator=_generator(seed, key))
    return fill


def scaled_normal_init(std: float, num_layers: int, seed: int, key: str):
    """Megatron's init for the output projections of residual branches: std / sqrt(2L)."""
    return normal_init(std / math.sqrt(2.0 * num_layers), seed, key)
