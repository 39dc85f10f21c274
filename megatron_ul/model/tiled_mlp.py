"""Tiled MLP (ALST): the MLP over tiles of the sequence, each tile recomputed in backward.

An MLP is token-wise, so running it tile by tile changes nothing but memory: only one
tile's intermediate ([c, b, ffn/TP], SwiGLU [c, b, 2·ffn/TP] plus its products) exists at a
time, in forward and in backward. Under Megatron-SP each TP rank cuts its own s/TP tokens into
the same number of tiles; fc1 all-gathers a tile from every TP rank and fc2 reduce-scatters
the result back in the same rank order, so every rank gets its own tile back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..mpu.recompute import checkpoint


def tiled_mlp(
    mlp: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_tokens: int
) -> torch.Tensor:
    """mlp(x) for x [s, b, h], computed over tiles of `tile_tokens` along s."""
    if x.shape[0] <= tile_tokens:
        return mlp(x)
    return torch.cat([checkpoint(mlp, piece) for piece in x.split(tile_tokens, dim=0)])
