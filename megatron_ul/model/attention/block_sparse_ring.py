"""Block-sparse attention across the ring: the ring's communication (ring.py: k/v blocks
travel forward, dk/dv accumulators travel again in backward) with each C×C unit run as the
layout's rectangles inside it (block_sparse.py).

A unit pairs local query chunk i with arriving chunk j (global chunk indices, j <= i). Its
piece of the layout, block rows [i·C/B, (i+1)·C/B) against block columns [j·C/B, ...), is cut
into rectangles once per shape; a unit whose piece is empty for every head is skipped without
a kernel call, and the documents and the window skip or mask rectangles from global token
positions as on one rank. The chunk (C = N/(2·CP)) must hold whole blocks (config rule).
Ring ranks hold chunks r and 2R-1-r, so each holds early and late rows of the layout: the
computed blocks per rank stay balanced (tests/model/test_block_sparse_ring.py measures it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ...data.sequence_layout import ring_chunks
from ...sparsity_config import SparsityPattern
from . import lse_kernels
from .block_sparse import Call, Rect, _bias, _cut, _merge, _Starts, rectangles
from .block_sparse_layouts import block_layout
from .documents import DocumentMask
from .lse_kernels import UnitKernel
from .ring import DKV_TAG, KV_TAG, Ring, _wait, packed_kv

MASK_TILE_ROWS = 512


@dataclass(frozen=True)
class RingCall:
    """One kernel call of a step: `call` in global token positions (what masks read), and
    where its rows start in the local sequence and its keys in the arriving block."""

    call: Call
    rows_at: int
    keys_at: int


class SparseRingPlan:
    """One rank's units per step: for each source rank, the (query chunk, key chunk) pieces
    of the layout with their rectangles per head group (global token positions)."""

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
        self.chunk = seq_length // (2 * ring.size)
        blocks = self.chunk // pattern.block
        local = len(heads)
        if pattern.different_layout_per_head:  # one query head with its kv head each
            group = local // kv_heads
            groups = [((h, h + 1), (h // group, h // group + 1), h) for h in range(local)]
        else:
            groups = [((0, local), (0, kv_heads), 0)]
        mine = ring_chunks(ring.rank, ring.size)
        # Only the layout rows of this rank's two chunks, per head group: [blocks, all blocks].
        rows = {
            (i, h): block_layout(
                pattern, num_heads, seq_length, seed=seed, layer=layer, heads=[heads[h]],
                rows=(i * blocks, (i + 1) * blocks),
            )[0]
            for i in mine
            for _, _, h in groups
        }  # fmt: skip
        self.units: list[list[tuple]] = []  # per source rank: (q chunk, kv chunk, i, j, ...)
        for src in range(ring.size):
            units = []
            for qc, i in enumerate(mine):
                for kc, j in enumerate(ring_chunks(src, ring.size)):
                    if j > i:
                        continue
                    pieces = []
                    for hs, kvs, h in groups:
                        piece = rows[i, h][:, j * blocks : (j + 1) * blocks]
                        rects = rectangles(piece.numpy(), pattern.block, diagonal=i == j)
                        shifted = [
                            Rect(
                                r.q0 + i * self.chunk,
                                r.q1 + i * self.chunk,
                                r.k0 + j * self.chunk,
                                r.k1 + j * self.chunk,
                                r.causal,
                            )
                            for r in rects
                        ]
                        if shifted:
                            pieces.append((hs, kvs, shifted))
                    if pieces:  # a unit whose layout piece is empty runs nothing
                        units.append((qc, kc, i, j, pieces))
            self.units.append(units)

    def calls(self, src: int, window: Optional[int], documents: Optional[_Starts]):
        """The kernel calls against src's block (host arithmetic only)."""
        out = []
        for qc, kc, i, j, pieces in self.units[src]:
            rows_shift, keys_shift = (qc - i) * self.chunk, (kc - j) * self.chunk
            for heads, kv, rects in pieces:
                for r in rects:
                    cut = _cut(r, window, documents)
                    if cut is None:
                        continue
                    for q0 in range(r.q0, r.q1, MASK_TILE_ROWS) if cut else (r.q0,):
                        q1 = min(q0 + MASK_TILE_ROWS, r.q1) if cut else r.q1
                        call = Call(heads, kv, q0, q1, r.k0, r.k1, r.causal and not cut, cut)
                        out.append(RingCall(call, q0 + rows_shift, r.k0 + keys_shift))
        return out


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.permute(1, 2, 0, 3)


def _slices(rc: RingCall):
    c = rc.call
    rows = slice(rc.rows_at, rc.rows_at + c.q1 - c.q0)
    keys = slice(rc.keys_at, rc.keys_at + c.k1 - c.k0)
    return slice(*c.heads), slice(*c.kv_heads), rows, keys


class _SparseRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, plan, window, documents, kernels, scale):
        dense, masked = kernels
        kv = packed_kv(k, v)
        out = torch.zeros(q.shape, dtype=lse_kernels.lse_dtype(q.dtype), device=q.device)
        lse = torch.full(
            (q.shape[1], q.shape[2], q.shape[0]), float("-inf"), dtype=out.dtype, device=q.device
        )
        qh, oh = _heads_first(q), _heads_first(out)
        spare = torch.empty_like(kv)
        for step in range(ring.size):
            pending = ring.start_shift(kv, spare, KV_TAG) if step < ring.size - 1 else []
            src = (ring.rank - step) % ring.size
            kh, vh = _heads_first(kv[0]), _heads_first(kv[1])
            for rc in plan.calls(src, window, documents):
                h, g, rows, keys = _slices(rc)
                c = rc.call
                bias = _bias(c, window, documents, q.dtype, q.device) if c.bias else None
                part, part_lse = (masked if c.bias else dense).forward(
                    qh[:, h, rows], kh[:, g, keys], vh[:, g, keys], c.causal, bias, scale
                )
                _merge(oh[:, h, rows], lse[:, h, rows], part, part_lse)
            _wait(pending)
            if pending:
                kv, spare = spare, kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.plan, ctx.window, ctx.documents = ring, plan, window, documents
        ctx.kernels, ctx.scale = kernels, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, plan, window, documents = ctx.ring, ctx.plan, ctx.window, ctx.documents
        dense, masked = ctx.kernels
        kv = packed_kv(k, v)
        spare = torch.empty_like(kv)
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=lse.dtype, device=kv.device)
        dkv_in = torch.empty_like(dkv)
        qh, oh, doh, dqh = (_heads_first(t) for t in (q, out, dout.to(q.dtype), dq))
        dkv_pending: list = []
        for step in range(ring.size):
            kv_pending = ring.start_shift(kv, spare, KV_TAG) if step < ring.size - 1 else []
            src = (ring.rank - step) % ring.size
            if step > 0:  # the accumulator of src's block, from the previous rank
                _wait(dkv_pending)
                dkv, dkv_in = dkv_in, dkv
            kh, vh = _heads_first(kv[0]), _heads_first(kv[1])
            dkh, dvh = _heads_first(dkv[0]), _heads_first(dkv[1])
            for rc in plan.calls(src, window, documents):
                h, g, rows, keys = _slices(rc)
                c = rc.call
                bias = _bias(c, window, documents, q.dtype, q.device) if c.bias else None
                gq, gk, gv = (masked if c.bias else dense).backward(
                    doh[:, h, rows],
                    qh[:, h, rows],
                    kh[:, g, keys],
                    vh[:, g, keys],
                    oh[:, h, rows],
                    lse[:, h, rows],
                    c.causal,
                    bias,
                    ctx.scale,
                )
                dqh[:, h, rows].add_(gq)
                dkh[:, g, keys].add_(gk)
                dvh[:, g, keys].add_(gv)
            dkv_pending = ring.start_shift(dkv, dkv_in, DKV_TAG)
            _wait(kv_pending)
            if kv_pending:
                kv, spare = spare, kv
        _wait(dkv_pending)
        grads = dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype)
        return (*grads, None, None, None, None, None, None)


def block_sparse_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: Ring,
    plan: SparseRingPlan,
    kernels: tuple[UnitKernel, UnitKernel],
    *,
    documents: Optional[DocumentMask] = None,
    window: Optional[int] = None,
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """This ring rank's local sequence (chunks r and 2R-1-r) against the whole sequence under
    the layout. q [L, b, hq, d]; k, v [L, b, hk, d]; returns [L, b, hq, d] in q's dtype."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    starts = None if documents is None else _Starts.of(documents)
    with torch.autocast(q.device.type, enabled=False):
        return _SparseRing.apply(q, k, v, ring, plan, window, starts, kernels, scale)


__all__ = ["SparseRingPlan", "block_sparse_ring_attention"]
