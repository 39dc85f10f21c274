"""Block-sparse attention as a plan of the blocked engine (blocks.py).

A head's layout (block_sparse_layouts.py), less the blocks causality hides, becomes blocks by
`blocks.layout_blocks`: diagonal squares on the kernel's causal flag, runs of key blocks
grown downwards where the next rows repeat them. Each block is one unit-kernel call, merged by
the engine's log-sum-exp; backward is the engine's (FlashAttention's, in place). Memory: q, k,
v, the output and the log-sum-exp, plus one call's scores inside its kernel; time: the
computed blocks. No [N, N] tensor exists.

Documents (--reset-attention-mask) and the window (--window-size) combine with the layout (a
token sees a key only where all three allow it): a block no query of which shares a document
with, or comes within the window of, any of its keys is skipped, decided on the host from the
documents' offsets; one they cut through runs with the engine's bias (MaskRules), in tiles of
ring.MASK_TILE_ROWS query rows so that no mask is quadratic.

Heads: the layout rows of this rank's GLOBAL heads (`SparseHeads`: Ulysses gives a rank heads
[r·h, (r+1)·h) of its TP slice). Where every head shares one layout, one call covers all of
them (GQA inside the kernel); per-head layouts run per query head with its kv head.

The unit kernels are the table's (backends.unit_kernel), the same the ring and the document
tiles run; the backend rows are backends.BlockSparse and backends.BlockSparseRing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ...sparsity_config import SparsityPattern
from .block_sparse_layouts import block_layout
from .blocks import Block, BlockedAttention, Kernels, Mask, MaskRules, layout_blocks
from .documents import DocumentMask
from .ring import MASK_TILE_ROWS, DocumentSpans

if TYPE_CHECKING:
    from ...mpu.parallel_state import ParallelDims


@dataclass(frozen=True)
class SparseHeads:
    """What a layer's block-sparse attention needs besides the tensors: the pattern, the
    model's query heads, the global index of this rank's first head (its heads are the next
    `q_heads` of the call), and the run's seed and the layer's number (the random blocks)."""

    pattern: SparsityPattern
    num_heads: int
    first: int = 0
    seed: int = 0
    layer: int = 0

    @classmethod
    def of(
        cls, m, dims: ParallelDims | None = None, seed: int = 0, layer: int = 0
    ) -> SparseHeads | None:
        """This rank's heads, [tp_rank·H/TP + sp_rank·H/(TP·SP), ...) (dims None: from head
        0, what selecting the kernel needs). `m`: the ModelConfig; None where it has no
        --sparse-attention."""
        pattern = SparsityPattern.of(m)
        if pattern is None:
            return None
        heads = m.num_attention_heads
        first = 0
        if dims is not None:
            first = dims.tp_rank * (heads // dims.tp) + dims.sp_rank * (
                heads // (dims.tp * dims.sp)
            )
        return cls(pattern, heads, first, seed, layer)


def head_layouts(
    pattern: SparsityPattern, heads: Sequence[int], kv_heads: int, layout_of: Callable
) -> list[tuple[tuple[int, int] | None, torch.Tensor]]:
    """(local query heads [h0, h1) or None for all, their layout) per group of heads that
    share one: `layout_of(global head)`. Consecutive heads with equal layouts share calls,
    in ranges the engine's blocks can take (inside one kv head's group, or whole groups)."""
    if not pattern.different_layout_per_head:
        return [(None, layout_of(heads[0]))]
    group = len(heads) // kv_heads
    runs: list[list] = []  # [h0, h1, layout]
    for h, g in enumerate(heads):
        layout = layout_of(g)
        if runs and torch.equal(runs[-1][2], layout):
            runs[-1][1] = h + 1
        else:
            runs.append([h, h + 1, layout])
    out: list[tuple[tuple[int, int] | None, torch.Tensor]] = []
    for h0, h1, layout in runs:
        # the partial groups at either end apart, the whole groups between as one range
        first, last = -(-h0 // group) * group, h1 // group * group
        if first >= last:
            cuts = sorted({h0, h1} | {x for x in range(first, h1, group) if h0 < x})
        else:
            cuts = sorted({h0, first, last, h1})
        out += [((a, b), layout) for a, b in zip(cuts, cuts[1:]) if a < b]
    return out


class SparsePlan:
    """One layer's blocks for a sequence length and this rank's heads (global indices)."""

    def __init__(
        self,
        pattern: SparsityPattern,
        num_heads: int,
        heads: Sequence[int],
        kv_heads: int,
        seq_length: int,
        seed: int,
        layer: int,
    ):
        def layout_of(g: int) -> torch.Tensor:
            layout = block_layout(pattern, num_heads, seq_length, seed=seed, layer=layer, heads=[g])
            return layout[0]

        self.blocks: list[Block] = []
        for hs, layout in head_layouts(pattern, heads, kv_heads, layout_of):
            self.blocks += layout_blocks(layout, pattern.block, heads=hs)

    def calls(self, window: int | None, documents: DocumentSpans | None) -> list[Block]:
        """The blocks to run, with those the documents or the window exclude left out and
        those they cut through masked, in tiles of rows (host arithmetic only)."""
        return cut_blocks(self.blocks, window, documents)


def cut_blocks(
    plan: Sequence[Block], window: int | None, documents: DocumentSpans | None
) -> list[Block]:
    """`plan` under the window and the documents: blocks nothing of which they let through
    dropped, blocks they cut through as Mask.BIAS tiles of MASK_TILE_ROWS rows."""
    out = []
    for block in plan:
        cut = _cut(block, window, documents)
        if cut is None:
            continue
        if not cut:
            out.append(block)
            continue
        for q0 in range(block.q0, block.q1, MASK_TILE_ROWS):
            q1 = min(q0 + MASK_TILE_ROWS, block.q1)
            q_at = None if block.q_at is None else block.q_at + q0 - block.q0
            out.append(replace(block, q0=q0, q1=q1, q_at=q_at, mask=Mask.BIAS))
    return out


def _cut(block: Block, window: int | None, documents: DocumentSpans | None):
    """None: nothing in the block is visible; True: a mask is needed; False: it runs as it
    is. The closest (query, key) pair is the first row and the last key (the first key of a
    diagonal square), the farthest the last row and the first key."""
    q0, q1 = block.q_positions()
    k0, k1 = block.k_positions()
    nearest = max(q0 - (k1 - 1), 0)
    farthest = q1 - 1 - k0
    if window is not None and nearest > window:
        return None
    cut = window is not None and farthest > window
    if documents is not None:
        samples = range(len(documents.starts))
        if block.mask is Mask.FULL and all(documents.span(s, k1 - 1)[1] <= q0 for s in samples):
            return None
        cut = cut or any(documents.span(s, k0)[1] < q1 for s in samples)
    return cut


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: SparsePlan,
    *,
    kernels: Kernels,
    documents: DocumentMask | None = None,
    window: int | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Causal block-sparse attention on whole heads. q [N, b, hq, d]; k, v [N, b, hk, d];
    `plan` made for N and these heads; `kernels` the table's (backends.unit_kernel). Returns
    [N, b, hq, d] in q's dtype."""
    n = q.shape[0]
    if documents is not None and documents.seq_length != n:
        raise ValueError(
            f"document offsets are for sequences of {documents.seq_length} tokens, "
            f"attention got {n}"
        )
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    spans = None if documents is None else DocumentSpans.of(documents)
    rules = MaskRules(window, None if spans is None else spans.ids)
    calls = plan.calls(window, spans)
    with torch.autocast(q.device.type, enabled=False):
        return BlockedAttention.apply(q, k, v, calls, kernels, rules, scale, 0.0)


class LayerSparsity:
    """One layer's pattern and its plans, one per (sequence length, heads, kv heads): the layout is
    drawn and cut into blocks once per shape, not per micro-batch."""

    def __init__(self, pattern: SparsityPattern, num_heads: int, seed: int, layer: int):
        self.pattern, self.num_heads, self.seed, self.layer = pattern, num_heads, seed, layer
        self._plans: dict = {}

    def plan(self, seq_length: int, heads: Sequence[int], kv_heads: int) -> SparsePlan:
        key = (seq_length, tuple(heads), kv_heads)
        if key not in self._plans:
            self._plans[key] = SparsePlan(
                self.pattern, self.num_heads, heads, kv_heads, seq_length, self.seed, self.layer
            )
        return self._plans[key]


__all__ = [
    "SparseHeads",
    "SparsePlan",
    "LayerSparsity",
    "block_sparse_attention",
    "cut_blocks",
    "head_layouts",
]
