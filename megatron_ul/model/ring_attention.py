"""Ring attention over the context-parallel (CP) group, causal and load-balanced.

The sequence is cut into 2R chunks; ring rank c holds chunks c and 2R-1-c (its "local
sequence", L = N/R tokens, in increasing global order; data/sequence_layout.py). Each of R
steps attends the local queries to one rank's k/v block while that block travels on to the
next rank (p2p, overlapped with the step's compute). Partial results merge with the
log-sum-exp rule:

    lse = logaddexp(lse_a, lse_b),   out = out_a·exp(lse_a - lse) + out_b·exp(lse_b - lse)

Causal work per step, with src the rank whose k/v arrived (C = L/2 tokens per chunk):
  src == c   the local L×L causal block (both chunks, diagonal blocks masked);
  src <  c   all L queries × src's first chunk (its second chunk is in everyone's future);
  src >  c   our second chunk × src's whole block (our first chunk precedes both of its chunks).
Every step costs L²/2 scores on every rank: the layout balances the causal triangle.

Backward is written out as in FlashAttention: with the final out and lse, a block's
probabilities are exp(S - lse) and D = rowsum(dout·out), so dq accumulates locally while each
k/v block travels around the ring again with its dk/dv accumulator, which takes one last hop
home. Nothing goes through autograd across p2p.

Document masking (--reset-attention-mask) composes: the full sequence's document offsets
(a DocumentMask, O(N)) become one document id per token, each block masks the query/key pairs
of different documents, and a block the documents exclude entirely is skipped, not computed.
A dense bool mask [b, 1, N, N] (True = masked) is accepted too, for tests.

The block kernel is plain fp32 matmul + softmax (exact, any device); a FlashAttention-style
fused kernel returning the log-sum-exp would replace `_block_forward`/`_block_backward`.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..mpu.comm_stats import record
from ..mpu.parallel_state import ParallelDims
from ..data.sequence_layout import ring_local_positions
from .document_attention import DocumentMask

KV_TAG, DKV_TAG = 11, 12   # distinct from the pipeline's tags; two streams share each link

# Optional time split (benchmarks): CPU seconds in block kernels, wall seconds blocked on p2p.
_times: Optional[dict] = None


@contextmanager
def measure_ring_time():
    """with measure_ring_time() as t: ... -> t == {"compute_cpu_s": .., "exposed_wait_s": ..,
    "forward_blocks": ..} for this rank: kernel work (thread CPU time, robust to oversubscribed
    cores), the wall time spent waiting for k/v or dk/dv that had not arrived (communication
    not hidden), and how many forward blocks were computed (masked-out ones are skipped)."""
    global _times
    previous, _times = _times, {"compute_cpu_s": 0.0, "exposed_wait_s": 0.0,
                                "forward_blocks": 0}
    try:
        yield _times
    finally:
        _times = previous


@contextmanager
def _timed(key: str, clock):
    if _times is None:
        yield
        return
    start = clock()
    try:
        yield
    finally:
        _times[key] += clock() - start


@dataclass(frozen=True)
class Ring:
    """This rank's place in the ring: its group, coordinate and neighbours (global ranks)."""
    group: Optional[dist.ProcessGroup]
    rank: int
    size: int
    next_rank: int
    prev_rank: int

    @classmethod
    def from_dims(cls, dims: ParallelDims) -> "Ring":
        return cls(dims.cp_group, dims.cp_rank, dims.cp, dims.cp_next_rank, dims.cp_prev_rank)

    def start_shift(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> list:
        """Send `send` to the next rank and receive the previous rank's into `recv`, async."""
        record("p2p", send, self.group)
        ops = [dist.P2POp(dist.isend, send, self.next_rank, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev_rank, self.group, tag)]
        return dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    with _timed("exposed_wait_s", time.perf_counter):
        for r in requests:
            r.wait()


# ---- which (query rows, key columns) each step computes ----------------------------------------
@dataclass(frozen=True)
class _Block:
    rows: slice
    cols: slice
    causal: bool          # the diagonal block: mask above the diagonal of the local order


def _causal_block(step: int, ring: Ring, local_len: int) -> _Block:
    half, everything = local_len // 2, slice(0, local_len)
    src = (ring.rank - step) % ring.size
    if src == ring.rank:
        return _Block(everything, everything, True)
    if src < ring.rank:
        return _Block(everything, slice(0, half), False)
    return _Block(slice(half, local_len), everything, False)


# ---- the block kernel: [b, hk, g·Lq, d] queries grouped under their kv head ----------------------
def _scores(q, k, scale, block: _Block, mask: Optional[torch.Tensor], group: int):
    """fp32 scores [b, hk, g·Lq, Lk] with masked entries at -inf."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if block.causal or mask is not None:
        b, hk, rows, lk = s.shape
        s = s.view(b, hk, group, rows // group, lk)
        if block.causal:
            lq = rows // group
            above = torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(1)
            s = s.masked_fill(above, float("-inf"))
        if mask is not None:   # [b, 1, Lq, Lk] -> broadcast over kv heads and the group
            s = s.masked_fill(mask.unsqueeze(2), float("-inf"))
        s = s.view(b, hk, rows, lk)
    return s


def _block_forward(q, k, v, scale, block, mask, group):
    """(out [b, hk, g·Lq, d], lse [b, hk, g·Lq]) of one block; rows that see nothing get
    out 0 and lse -inf (they merge as a no-op)."""
    s = _scores(q, k, scale, block, mask, group)
    row_max = s.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(s - row_max)
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v) / total.clamp_min(torch.finfo(total.dtype).tiny)
    lse = (row_max + total.log()).squeeze(-1)
    return out, lse


def _merge(out, lse, block_out, block_lse):
    """Log-sum-exp merge of a block's partial result into (out, lse), in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    finite = torch.isfinite(new_lse)
    safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
    old_w = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(lse))
    new_w = torch.where(finite, torch.exp(block_lse - safe), torch.zeros_like(lse))
    out.mul_(old_w.unsqueeze(-1)).add_(block_out * new_w.unsqueeze(-1))
    lse.copy_(new_lse)


def _block_backward(q, k, v, dout, lse, delta, scale, block, mask, group):
    """(dq, dk, dv) of one block given the FINAL out's lse and delta = rowsum(dout·out)."""
    s = _scores(q, k, scale, block, mask, group)
    p = torch.exp(s - lse.unsqueeze(-1))              # exactly 0 where masked
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return dq, dk, dv


# ---- layout helpers ----------------------------------------------------------------------------
def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types (scores, softmax and the merge need its range), else unchanged."""
    return torch.promote_types(dtype, torch.float32)


def _grouped_queries(q: torch.Tensor, hk: int) -> torch.Tensor:
    """[L, b, hq, d] -> [b, hk, g·L, d] (fp32 or wider): query head i sits under kv head
    i // g."""
    length, b, hq, d = q.shape
    g = hq // hk
    grouped = q.to(_accumulation_dtype(q.dtype)).permute(1, 2, 0, 3)     # [b, hq, L, d]
    return grouped.reshape(b, hk, g * length, d)


def _ungrouped(x: torch.Tensor, length: int) -> torch.Tensor:
    """[b, hk, g·L, d] -> [L, b, hq, d]."""
    b, hk, rows, d = x.shape
    g = rows // length
    return x.view(b, hk * g, length, d).permute(2, 0, 1, 3)


def _row_view(x: torch.Tensor, group: int, rows: slice) -> torch.Tensor:
    """Rows `rows` of the local sequence, for every query head of the group: a view (when
    contiguous) of x [b, hk, g·L, ...] as [b, hk, g, |rows|, ...]."""
    b, hk, gl = x.shape[:3]
    return x.view(b, hk, group, gl // group, *x.shape[3:])[:, :, :, rows]


def _flat(x: torch.Tensor) -> torch.Tensor:
    b, hk, g, lq = x.shape[:4]
    return x.reshape(b, hk, g * lq, *x.shape[4:])


def _packed_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [L, b, hk, d] -> one contiguous [2, b, hk, L, d] buffer in the model's dtype: one
    message per step (upcast per block, at compute)."""
    return torch.stack([k, v]).permute(0, 2, 3, 1, 4).contiguous()


def _kv_block(kv: torch.Tensor, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
    acc = _accumulation_dtype(kv.dtype)
    return kv[0][:, :, cols].to(acc), kv[1][:, :, cols].to(acc)


def _block_mask(mask, positions, ring: Ring, src: int, block: _Block):
    """The attention mask's slice for this block: [b, 1, |rows|, |cols|], or None. ``mask``
    is a dense bool [b, 1, N, N] or document ids [b, N] (masked across documents)."""
    if mask is None:
        return None
    rows, cols = positions[ring.rank][block.rows], positions[src][block.cols]
    if mask.dtype == torch.bool:
        return mask[:, :, rows][:, :, :, cols]
    return (mask[:, rows].unsqueeze(-1) != mask[:, cols].unsqueeze(-2)).unsqueeze(1)


def _document_ids(documents: DocumentMask) -> torch.Tensor:
    """[b, N] index of each token's document, from the full sequence's cu_seqlens (O(N))."""
    cu = documents.cu_seqlens.long()
    flat = torch.arange(int(cu[-1]), device=cu.device)
    ids = torch.searchsorted(cu[1:], flat, right=True)
    return ids.view(documents.batch_size, -1)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float, mask, positions):
        # q [L, b, hq, d]; k, v [L, b, hk, d]; mask None or bool [b, 1, N, N] (True = masked);
        # positions: global token index of every ring rank's local sequence, [R, L].
        length, hk = q.shape[0], k.shape[2]
        group = q.shape[2] // hk
        qg = _grouped_queries(q, hk)
        kv = _packed_kv(k, v)
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:3], float("-inf"), dtype=qg.dtype, device=q.device)
        spare = torch.empty_like(kv)
        for step in range(ring.size):
            pending = ring.start_shift(kv, spare, KV_TAG) if step < ring.size - 1 else []
            block = _causal_block(step, ring, length)
            src = (ring.rank - step) % ring.size
            bmask = _block_mask(mask, positions, ring, src, block)
            if bmask is None or not bool(bmask.all()):
                if _times is not None:
                    _times["forward_blocks"] += 1
                with _timed("compute_cpu_s", time.thread_time):
                    block_out, block_lse = _block_forward(_flat(_row_view(qg, group, block.rows)),
                                          *_kv_block(kv, block.cols), scale, block, bmask, group)
                rows_out = _row_view(out, group, block.rows)      # views: merged in place
                rows_lse = _row_view(lse, group, block.rows)
                _merge(rows_out, rows_lse, block_out.view(rows_out.shape),
                       block_lse.view(rows_lse.shape))
            _wait(pending)
            if pending:
                kv, spare = spare, kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.mask, ctx.positions = ring, scale, mask, positions
        return _ungrouped(out, length).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, mask, positions = ctx.ring, ctx.scale, ctx.mask, ctx.positions
        length, hk = q.shape[0], k.shape[2]
        group = q.shape[2] // hk
        qg, dog = _grouped_queries(q, hk), _grouped_queries(dout, hk)
        delta = (dog * out).sum(-1)                                   # [b, hk, g·L]
        kv = _packed_kv(k, v)
        spare = torch.empty_like(kv)
        dq = torch.zeros_like(qg)
        # dk/dv accumulators travel in fp32 (or wider): sums of R partial gradients.
        dkv = torch.zeros(kv.shape, dtype=qg.dtype, device=kv.device)
        dkv_in = torch.empty_like(dkv)
        dkv_pending: list = []
        for step in range(ring.size):
            kv_pending = ring.start_shift(kv, spare, KV_TAG) if step < ring.size - 1 else []
            block = _causal_block(step, ring, length)
            src = (ring.rank - step) % ring.size
            bmask = _block_mask(mask, positions, ring, src, block)
            if step > 0:   # the accumulator of src's block, from the previous rank
                _wait(dkv_pending)
                dkv, dkv_in = dkv_in, dkv
            if bmask is None or not bool(bmask.all()):
                q_b, do_b, lse_b, delta_b = (_flat(_row_view(t, group, block.rows))
                                             for t in (qg, dog, lse, delta))
                with _timed("compute_cpu_s", time.thread_time):
                    dq_b, dk_b, dv_b = _block_backward(
                        q_b, *_kv_block(kv, block.cols), do_b, lse_b, delta_b, scale, block,
                        bmask, group)
                _row_view(dq, group, block.rows).add_(dq_b.view(
                    _row_view(dq, group, block.rows).shape))
                dkv[0][:, :, block.cols].add_(dk_b)
                dkv[1][:, :, block.cols].add_(dv_b)
            # Pass src's accumulator on; after the last step it reaches its owner.
            dkv_pending = ring.start_shift(dkv, dkv_in, DKV_TAG)
            _wait(kv_pending)
            if kv_pending:
                kv, spare = spare, kv
        _wait(dkv_pending)
        dk, dv = dkv_in.permute(0, 3, 1, 2, 4).to(k.dtype)            # [2, L, b, hk, d]
        return (_ungrouped(dq, length).to(q.dtype), dk, dv, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, *,
                   attention_mask: Optional[torch.Tensor] = None,
                   softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of this ring rank's local sequence (chunks r and 2R-1-r) against the
    whole sequence. q [L, b, hq, d]; k, v [L, b, hk, d] (hq a multiple of hk); returns
    [L, b, hq, d]. attention_mask: None, the full sequence's DocumentMask, or a dense bool
    [b, 1, N, N] over the full sequence (True = masked)."""
    length = q.shape[0]
    if length % 2:
        raise ValueError(f"ring attention needs an even local sequence (two chunks), got {length}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    positions = None
    if isinstance(attention_mask, DocumentMask):
        attention_mask = _document_ids(attention_mask)
    if attention_mask is not None:
        seq = length * ring.size
        positions = torch.stack([ring_local_positions(r, ring.size, seq)
                                 for r in range(ring.size)]).to(attention_mask.device)
    # The block kernel chooses its own precision (fp32 accumulation for half types): autocast
    # would run the forward's matmuls in bf16 and the backward's (outside autocast) in fp32,
    # and exp(S - lse) would then not be the forward's probabilities.
    with torch.autocast(q.device.type, enabled=False):
        return _RingAttention.apply(q, k, v, ring, scale, attention_mask, positions)
