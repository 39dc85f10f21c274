"""Documents and sliding windows on fused kernels, without a Python loop per document.

The sequence is cut into query tiles of TILE tokens. A tile's queries split at most once: the
rows of the document that began before the tile (they may see keys back to that document's
start or the window's) and the rows of documents that begin inside it (they see only keys of
the tile). Each part attends to a key range in at most three kernel calls: one unmasked call
over the whole key tiles that every row of the part sees, and masked calls (an additive bias of
at most TILE × TILE) for the key tiles that the window, a document start or causality cuts.
Calls per tile do not depend on how many documents there are; the calls are planned on the
host from the offsets (read once per micro-batch). Partial results merge with the log-sum-exp,
backward takes the final lse and adds each call's gradients into dq, dk, dv in place.

Kernels: lse_kernels (torch's efficient kernel on CUDA, its CPU flash kernel on CPU), run by
the blocked engine (blocks.py): the tiles are a plan of its blocks.

Attention dropout runs inside the efficient kernel: each call drops its block of the
normalised probabilities with the philox seed and offset it draws from the device generator,
and its lse stays that of the undropped scores, so the merge by lse is as exact as without
dropout. Backward hands each call the seed and offset its forward drew (no generator state is
consumed there); a recomputed forward (activation checkpointing) replays the generator and so
draws the same ones.
"""

from __future__ import annotations

import bisect

from . import blocks, lse_kernels
from .blocks import Block, Kernels, Mask, MaskRules

TILE = 512


def _call(sample, q0, q1, k0, k1, masked: bool) -> Block:
    """Queries [q0, q1) of one sample against keys [k0, k1); masked: needs a bias."""
    return Block(q0, q1, k0, k1, Mask.BIAS if masked else Mask.FULL, sample)


def _key_calls(sample, q0, q1, lo, window, tile) -> list[Block]:
    """Queries [q0, q1), all of one document starting at or before `lo`'s document start, whose
    first visible key is `lo`: the whole key tiles every row sees in one unmasked call, the
    rest masked."""
    # key j is seen by every row iff j >= lo_last (the last row's first key) and j < q0
    lo_last = lo if window is None else max(lo, q1 - 1 - window)
    full0 = -(-lo_last // tile) * tile  # first whole tile that every row sees
    full1 = (q0 // tile) * tile if full0 < q0 else full0
    calls = []
    if full1 > full0:
        calls.append(_call(sample, q0, q1, full0, full1, False))
        if full0 > lo:
            calls.append(_call(sample, q0, q1, lo, full0, True))
        calls.append(_call(sample, q0, q1, full1, q1, True))
    else:
        calls.append(_call(sample, q0, q1, lo, q1, True))
    return calls


def plan(
    starts: list[list[int]], n: int, window: int | None, tile: int | None = None
) -> list[Block]:
    """The kernel calls for documents starting at `starts` per sample (positions in [0, n)),
    in query tiles of `tile` tokens (default TILE, read at call time)."""
    tile = TILE if tile is None else tile
    calls = []
    for sample, doc_starts in enumerate(starts):
        for q0 in range(0, n, tile):
            q1 = min(q0 + tile, n)
            first = doc_starts[bisect.bisect_right(doc_starts, q0) - 1]
            inside = bisect.bisect_left(doc_starts, q0 + 1)
            split = (
                doc_starts[inside] if inside < len(doc_starts) and doc_starts[inside] < q1 else q1
            )
            lo = first if window is None else max(first, q0 - window)
            calls += _key_calls(sample, q0, split, lo, window, tile)
            if split < q1:  # documents that begin inside the tile see only the tile
                calls.append(_call(sample, split, q1, split, q1, True))
    return calls


def document_starts(offsets: list[int], n: int, batch: int) -> list[list[int]]:
    """Per sample, its documents' start positions, from offsets over the flattened [b·N]."""
    starts: list[list[int]] = [[] for _ in range(batch)]
    for offset in offsets[:-1]:
        sample, position = divmod(offset, n)
        starts[sample].append(position)
    return starts


def tiled_document_attention(
    q,
    k,
    v,
    documents,
    window: int | None,
    softmax_scale: float | None,
    kernel: lse_kernels.UnitKernel,
    *,
    dropout_p: float = 0.0,
):
    """Causal attention within `documents` (a DocumentMask or None) and the window, with
    attention dropout `dropout_p` (torch's efficient kernel only)."""
    if dropout_p > 0 and kernel is not lse_kernels.SDPA_EFFICIENT:
        raise ValueError(
            f"--attention-dropout {dropout_p}: the document tiles take attention dropout on "
            f"torch's efficient kernel only, not on {kernel.name}"
        )
    n, b = q.shape[:2]
    offsets = documents.offsets if documents is not None else list(range(0, b * n + 1, n))
    ids = documents.token_documents() if documents is not None else None
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    calls = plan(document_starts(offsets, n, b), n, window)
    return blocks.BlockedAttention.apply(
        q, k, v, calls, Kernels(kernel, kernel), MaskRules(window, ids), scale, dropout_p
    )
