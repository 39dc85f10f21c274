"""Tiled output layer + vocab-parallel cross entropy (ALST's tiled logits loss).

The logits of N tokens are [N, b, V/TP] fp32, by far the largest activation at long N (256 KB
per token for a 32K vocabulary at TP=1, plus their gradient). Here the final hidden states are
cut into tiles along this rank's sequence, and each tile's logits and softmax are computed,
reduced to a per-token loss and dropped at once; backward recomputes one tile's logits at a
time (mpu.recompute.checkpoint per tile). Peak: one tile's logits and their gradient.

Under Megatron-SP every TP rank holds s/TP tokens of the final hidden states and the output
layer all-gathers them; a tile of c local tokens becomes TP·c gathered rows, rank-major, so
the labels of tile k are taken as labels[r·s/TP + k·c : ...] for every TP rank r, and the
per-tile losses are put back in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..mpu.cross_entropy import vocab_parallel_cross_entropy
from ..mpu.recompute import checkpoint


def tiled_logits_loss(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    tile_tokens: int,
    gathered_ranks: int,
    tp_group,
) -> torch.Tensor:
    """Per-token loss [s, b] (fp32) of logits_fn(hidden) against labels, tile by tile.

    hidden: [s / gathered_ranks, b, h], this rank's final hidden states.
    labels: [s, b] target ids for the sequence logits_fn produces rows for.
    gathered_ranks: how many ranks' sequence shards logits_fn all-gathers (TP under
    Megatron-SP, else 1). tp_group: the vocabulary's TP group (None: one rank).
    """
    local, b = hidden.shape[:2]
    if labels.shape[0] != local * gathered_ranks:
        raise ValueError(
            f"labels cover {labels.shape[0]} tokens, hidden states {local}×{gathered_ranks}"
        )

    def tile_loss(piece: torch.Tensor, piece_labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_fn(piece), piece_labels, vocab_size, tp_group)

    by_rank = labels.reshape(gathered_ranks, local, b)
    losses, start = [], 0
    for piece in hidden.split(tile_tokens, dim=0):
        n = piece.shape[0]
        piece_labels = by_rank[:, start : start + n].reshape(gathered_ranks * n, b)
        loss = checkpoint(tile_loss, piece, piece_labels)
        losses.append(loss.view(gathered_ranks, n, b))
        start += n
    return torch.cat(losses, dim=1).view(gathered_ranks * local, b)
