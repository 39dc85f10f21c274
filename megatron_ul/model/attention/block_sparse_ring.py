"""Block-sparse attention across the ring: the ring's communication and steps (ring.py:
k/v blocks travel forward, dk/dv accumulators travel again in backward) with each C×C unit run
as the blocked engine's blocks of the layout's piece inside it.

A unit pairs local query chunk i with arriving chunk j (global chunk indices, j <= i). Its
piece of the layout, block rows [i·C/B, (i+1)·C/B) against block columns [j·C/B, ...), becomes
blocks once per shape (blocks.layout_blocks, causal on the diagonal unit only); a unit whose
piece is empty for every head is skipped without a kernel call, and the documents and the
window skip or mask blocks from global token positions as on one rank (block_sparse.cut_blocks).
The chunk (C = N/(2·CP)) must hold whole blocks (config rule). Ring ranks hold chunks r and
2R-1-r, so each holds early and late rows of the layout: the computed blocks per rank stay
balanced (tests/model/test_block_sparse_ring.py measures it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ...data.sequence_layout import ring_chunks
from ...sparsity_config import SparsityPattern
from .block_sparse import cut_blocks, head_layouts
from .block_sparse_layouts import block_layout
from .blocks import Block, Kernels, MaskRules, layout_blocks
from .documents import DocumentMask
from .ring import DocumentSpans, Ring, run_ring_plan


@dataclass(frozen=True)
class SparseUnit:
    """Local query chunk `q` (0 or 1) against chunk `kv` (0 or 1) of the arriving block, global
    chunks i and j; `blocks`: the layout piece's blocks in local rows (`q_at`, `k_at`: global
    token positions)."""

    q: int
    kv: int
    i: int
    j: int
    blocks: tuple[Block, ...]


class SparseRingPlan:
    """One rank's units per source rank: the (query chunk, key chunk) pieces of the layout
    that hold a block for some head, as engine blocks."""

    def __init__(
        self,
        pattern: SparsityPattern,
        num_heads: int,
        heads: Sequence[int],
        kv_heads: int,
        seq_length: int,
        ring: Ring,
        seed: int,
        layer: int,
    ):
        self.chunk = c = seq_length // (2 * ring.size)
        per_chunk = c // pattern.block
        mine = ring_chunks(ring.rank, ring.size)
        # Only the layout rows of this rank's two chunks, per head group: [blocks, all blocks].
        groups = {
            i: head_layouts(
                pattern, heads, kv_heads,
                lambda g, i=i: block_layout(
                    pattern, num_heads, seq_length, seed=seed, layer=layer, heads=[g],
                    rows=(i * per_chunk, (i + 1) * per_chunk),
                )[0],
            )
            for i in mine
        }  # fmt: skip
        self.units: list[list[SparseUnit]] = []
        for src in range(ring.size):
            units = []
            for qc, i in enumerate(mine):
                for kc, j in enumerate(ring_chunks(src, ring.size)):
                    if j > i:
                        continue
                    found: list[Block] = []
                    for hs, rows in groups[i]:
                        piece = rows[:, j * per_chunk : (j + 1) * per_chunk]
                        for b in layout_blocks(piece, pattern.block, heads=hs, causal=i == j):
                            found.append(
                                replace(
                                    b,
                                    q0=b.q0 + qc * c,
                                    q1=b.q1 + qc * c,
                                    k0=b.k0 + kc * c,
                                    k1=b.k1 + kc * c,
                                    q_at=b.q0 + i * c,
                                    k_at=b.k0 + j * c,
                                )
                            )
                    if found:  # a unit whose layout piece is empty runs nothing
                        units.append(SparseUnit(qc, kc, i, j, tuple(found)))
            self.units.append(units)

    def bind(
        self, window: int | None, documents: DocumentSpans | None, kernels: Kernels
    ) -> _BoundPlan:
        """The plan of one call (ring.StepPlan): its window, documents and unit kernels."""
        return _BoundPlan(self, window, documents, kernels)


@dataclass(frozen=True)
class _BoundPlan:
    sparse: SparseRingPlan
    window: int | None
    documents: DocumentSpans | None
    kernels: Kernels

    @property
    def rules(self) -> MaskRules:
        return MaskRules(self.window, None if self.documents is None else self.documents.ids)

    def step_blocks(self, src: int) -> tuple[list[Block], int]:
        """The blocks against src's block (host arithmetic only) and their units."""
        units = self.sparse.units[src]
        blocks = [b for u in units for b in u.blocks]
        return cut_blocks(blocks, self.window, self.documents), len(units)


def block_sparse_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: Ring,
    plan: SparseRingPlan,
    kernels: Kernels,
    *,
    documents: DocumentMask | None = None,
    window: int | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """This ring rank's local sequence (chunks r and 2R-1-r) against the whole sequence under
    the layout. q [L, b, hq, d]; k, v [L, b, hk, d]; returns [L, b, hq, d] in q's dtype."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    spans = None if documents is None else DocumentSpans.of(documents)
    with torch.autocast(q.device.type, enabled=False):
        return run_ring_plan(q, k, v, ring, plan.bind(window, spans, kernels), scale)


__all__ = ["SparseRingPlan", "SparseUnit", "block_sparse_ring_attention"]
