"""Sequence tiling of the attention block (ALST): the token-wise work around the attention
kernel — input norm, QKV projection, RoPE, output projection — over tiles of the sequence,
each tile checkpointed and recomputed in backward (as the tiled MLP does).

Only q, k, v and the attention output exist at full local length. The norm output, the fused
QKV output and its gradient, RoPE's fp32 temporaries and the projection's re-laid-out input
exist one tile at a time, in forward and in backward.

Under Megatron-SP each TP rank cuts its own s/TP tokens into the same number of tiles; the
QKV projection all-gathers tile k from every TP rank, so its rows come rank-major: [rank 0's
tile k, rank 1's tile k, ...]. `tile_rows` picks the same rows out of a full-length tensor
(RoPE's cos/sin, the attention output) and `merge_tiles` puts every tile's rows back in
sequence order; the output projection's reduce-scatter then hands each rank its own tile k.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...mpu.recompute import checkpoint


def tile_rows(t: torch.Tensor, tiles: int, k: int, ranks: int) -> torch.Tensor:
    """The rows of t [s, ...] (full local length) that tile k holds: of each of `ranks`
    equal blocks of s (the Megatron-SP shards; 1 without it), its k-th of `tiles` pieces,
    rank-major. A view when ranks == 1."""
    blocks = t.unflatten(0, (ranks, tiles, t.shape[0] // (ranks * tiles)))
    return blocks[:, k].flatten(0, 1)


def merge_tiles(pieces: list[torch.Tensor], ranks: int) -> torch.Tensor:
    """The inverse of tile_rows over every tile: pieces [ranks·c, ...] -> [s, ...] in sequence
    order. Empties `pieces`, so each tile dies once copied into the result."""
    blocks = [pieces.pop(0).unflatten(0, (ranks, -1)) for _ in range(len(pieces))]
    return torch.stack(blocks, dim=1).flatten(0, 2)


def tiled_attention_block(
    project: Callable[..., list[torch.Tensor]],
    attend: Callable[[list[torch.Tensor]], torch.Tensor],
    output: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    tiles: int,
    ranks: int,
) -> torch.Tensor:
    """output(attend(project(x, rotary))) with project and output run tile by tile.

    project(x_tile, rotary_tile) -> [q, k, v] of the tile's (gathered) rows; attend([q, k, v])
    -> the attention output [s, b, heads, d] (it empties the list); output(out_rows) -> the
    projected rows, this rank's own under Megatron-SP. x [s/ranks, b, h] is this rank's layer
    input."""

    def project_tile(x_tile, k, *cos_sin):
        rows = tuple(tile_rows(t, tiles, k, ranks) for t in cos_sin)
        return tuple(project(x_tile, rows or None))

    cos_sin = rotary if rotary is not None else ()
    per_tile = [checkpoint(project_tile, x_k, k, *cos_sin) for k, x_k in enumerate(x.chunk(tiles))]
    columns = [list(column) for column in zip(*per_tile)]  # [q tiles, k tiles, v tiles]
    del per_tile
    qkv = [merge_tiles(column, ranks) for column in columns]
    del columns
    out = attend(qkv)

    def output_tile(out_rows):
        return output(out_rows.flatten(0, 1))

    # Each tile saves a view of `out` (no copy) and re-lays out its own rows inside; its
    # gradient is tile-sized (a row selection inside the checkpoint would give each tile a
    # zero-filled full-length gradient of `out`).
    out_tiles = out.unflatten(0, (ranks, tiles, out.shape[0] // (ranks * tiles))).unbind(1)
    del out
    return torch.cat([checkpoint(output_tile, out_k) for out_k in out_tiles])
