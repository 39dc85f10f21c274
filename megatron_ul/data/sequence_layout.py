"""Which tokens of a sequence each Ulysses and ring rank holds: the one rule that the data
path (tokens, labels, loss masks, position ids) and ring attention share.

Without a ring (R = 1) the U Ulysses ranks hold contiguous N/U slices in rank order. With a
ring of R ranks the sequence is cut into 2R chunks and ring rank r holds chunks r and
2R-1-r (Megatron-LM's causal load balance: an early chunk, which attends to little, paired
with a late one, which attends to much); its U Ulysses ranks split that pair of chunks into
contiguous slices, so that the Ulysses all-to-all gathers the pair in order.
"""

from __future__ import annotations

import torch


def ring_chunks(ring_rank: int, ring_size: int) -> tuple[int, int]:
    """The two chunks (of 2R, in increasing order) that ring rank r holds: r and 2R-1-r."""
    return ring_rank, 2 * ring_size - 1 - ring_rank


def ring_local_positions(ring_rank: int, ring_size: int, seq_length: int) -> torch.Tensor:
    """Global token indices of a ring rank's local sequence (chunks r and 2R-1-r), [N/R]."""
    if ring_size == 1:
        return torch.arange(seq_length)
    chunk = seq_length // (2 * ring_size)
    return torch.cat(
        [torch.arange(i * chunk, (i + 1) * chunk) for i in ring_chunks(ring_rank, ring_size)]
    )


def rank_positions(
    seq_length: int, ulysses_rank: int, ulysses_size: int, ring_rank: int = 0, ring_size: int = 1
) -> torch.Tensor:
    """Global token indices held by the rank at (Ulysses rank, ring rank), [N/(U·R)]."""
    if ring_size > 1 and seq_length % (2 * ring_size * ulysses_size):
        raise ValueError(
            f"sequence length {seq_length} is not divisible by 2·U·R = 2·{ulysses_size}·{ring_size}"
        )
    if seq_length % ulysses_size:
        raise ValueError(f"sequence length {seq_length} is not divisible by U = {ulysses_size}")
    local = ring_local_positions(ring_rank, ring_size, seq_length)
    return local.chunk(ulysses_size)[ulysses_rank]
