"""Ring attention over the context-parallel (CP) group, causal and load-balanced.

The sequence is cut into 2R chunks of C tokens; ring rank c holds chunks c and 2R-1-c (its
"local sequence", L = 2C tokens; data/sequence_layout.py). Each of R steps attends the local
queries to one rank's k/v block while that block travels on to the next rank (p2p, overlapped
with the step's compute). Partial results merge with the log-sum-exp rule:

    lse = logaddexp(lse_a, lse_b),   out = out_a·exp(lse_a - lse) + out_b·exp(lse_b - lse)

Every step is decomposed into C×C units: (local query chunk, k/v chunk of the arriving block),
compared by their global chunk indices i (queries) and j (keys):
  j >  i   skipped (the keys are all in the queries' future);
  j == i   a causal unit (the diagonal of the full causal matrix);
  j <  i   a full unit.
With chunks c and 2R-1-c this gives every rank the same kernel sequence, not only the same
score count: its own step is causal, full, causal; each other step is two full units (from a
later rank: our late chunk against both of its chunks; from an earlier rank: both our chunks
against its early chunk). Equal shapes matter: one L×C matmul and one C×L matmul cost the same
flops but not the same time, which left R = 4 at 1.15 max/min before this decomposition.

Masks compose per unit, from global token positions (chunk index · C + offset):
  --window-size LEFT 0: query i sees keys i-LEFT..i. A unit whose smallest distance
    (i-j)·C - (C-1) exceeds LEFT is skipped without compute, decided from the chunk indices
    alone; a unit that the window cuts through is masked. A step whose units are all skipped
    still passes its k/v (and, backward, its dk/dv) on: the ring's order does not change.
  documents (--reset-attention-mask): the full sequence's document offsets (a DocumentMask,
    O(N)) become one document id per token; a unit masks pairs across documents and is
    skipped when the documents exclude all of it. A dense bool mask [b, 1, N, N] (True =
    masked) is accepted too, for tests.

Backward is written out as in FlashAttention: with the final out and lse, a unit's
probabilities are exp(S - lse) and D = rowsum(dout·out), so dq accumulates locally while each
k/v block travels around the ring again with its dk/dv accumulator, which takes one last hop
home. Nothing goes through autograd across p2p.

The unit kernel is plain fp32 matmul + softmax (exact, any device); a FlashAttention-style
fused kernel returning the log-sum-exp would replace `_unit_forward`/`_unit_backward`.
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
from ..data.sequence_layout import ring_chunks
from .document_attention import DocumentMask

KV_TAG, DKV_TAG = 11, 12   # labels only: NCCL ignores tags, the posting order pairs messages

# Optional time split (benchmarks): CPU seconds in unit kernels, wall seconds blocked on p2p.
_times: Optional[dict] = None


@contextmanager
def measure_ring_time():
    """with measure_ring_time() as t: ... -> t == {"compute_cpu_s": .., "exposed_wait_s": ..,
    "forward_blocks": ..} for this rank: kernel work (thread CPU time, robust to oversubscribed
    cores), the wall time spent waiting for k/v or dk/dv that had not arrived (communication
    not hidden), and how many forward C×C units were computed (excluded ones are skipped)."""
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
        """Send `send` to the next rank and receive the previous rank's into `recv`, async.

        One batch_isend_irecv: NCCL completes a communicator's operations in issue order and a
        large send only once the peer receives, so a lone send before the receive would
        deadlock the ring. Every rank posts the same sequence of shifts (forward: k/v per
        step; backward: k/v, then dk/dv, per step), so the k-th message from a rank meets the
        k-th receive of its neighbour (tests/model/test_ring_nccl.py runs it under NCCL's
        rules)."""
        record("p2p", send, self.group)
        ops = [dist.P2POp(dist.isend, send, self.next_rank, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev_rank, self.group, tag)]
        return dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    with _timed("exposed_wait_s", time.perf_counter):
        for r in requests:
            r.wait()


# ---- which C×C units each step computes ----------------------------------------------------------
@dataclass(frozen=True)
class _Unit:
    """Local query chunk `q` (0 or 1) against chunk `kv` (0 or 1) of the arriving block; `i`
    and `j` are their global chunk indices."""
    q: int
    kv: int
    i: int
    j: int


def _units(q_chunks: tuple[int, int], kv_chunks: tuple[int, int], chunk: int,
           window: Optional[int]) -> list[_Unit]:
    """The units of one step that causality and the window do not exclude, query-chunk major.
    Relative position of query a vs key b in a unit: (i - j)·C + a - b."""
    units = []
    for q, i in enumerate(q_chunks):
        for kv, j in enumerate(kv_chunks):
            if j > i:
                continue                                  # the keys are in the future
            if window is not None and (i - j) * chunk - (chunk - 1) > window:
                continue                                  # every key is beyond the window
            units.append(_Unit(q, kv, i, j))
    return units


def _unit_mask(unit: _Unit, chunk: int, window: Optional[int], mask: Optional[torch.Tensor],
               device) -> Optional[torch.Tensor]:
    """bool [b or 1, 1, C, C] (True = masked) or None: causal on the diagonal, the window
    where it cuts the unit, and the documents / dense mask (``mask``: document ids [b, N] or
    a dense bool [b, 1, N, N])."""
    result = None
    offset = (unit.i - unit.j) * chunk
    if unit.i == unit.j or (window is not None and offset + chunk - 1 > window):
        r = torch.arange(chunk, device=device)
        distance = offset + r.unsqueeze(1) - r.unsqueeze(0)
        result = distance < 0
        if window is not None:
            result |= distance > window
        result = result.view(1, 1, chunk, chunk)
    if mask is not None:
        rows = slice(unit.i * chunk, (unit.i + 1) * chunk)
        cols = slice(unit.j * chunk, (unit.j + 1) * chunk)
        if mask.dtype == torch.bool:
            extra = mask[:, :, rows, cols]
        else:
            extra = (mask[:, rows].unsqueeze(-1) != mask[:, cols].unsqueeze(-2)).unsqueeze(1)
        result = extra if result is None else result | extra
    return result


@dataclass(frozen=True)
class _Plan:
    """What one rank computes: the global chunks of each ring rank, C, window and mask."""
    rank: int
    chunks: tuple[tuple[int, int], ...]    # per ring rank
    chunk: int
    window: Optional[int]
    mask: Optional[torch.Tensor]

    def step(self, src: int, device) -> list[tuple[_Unit, Optional[torch.Tensor]]]:
        """The (unit, mask) pairs to compute against src's block; units that the mask
        excludes entirely are dropped (one host sync per unit, only with a mask)."""
        work = []
        for unit in _units(self.chunks[self.rank], self.chunks[src], self.chunk, self.window):
            m = _unit_mask(unit, self.chunk, self.window, self.mask, device)
            if m is not None and self.mask is not None and bool(m.all()):
                continue
            work.append((unit, m))
        return work


# ---- the unit kernel: [b, hk, g·C, d] queries grouped under their kv head ----------------------
def _scores(q, k, scale, mask: Optional[torch.Tensor], group: int):
    """fp32 scores [b, hk, g·C, C] with masked entries at -inf."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:   # [b|1, 1, Cq, Ck] -> broadcast over kv heads and the group
        b, hk, rows, lk = s.shape
        s = s.view(b, hk, group, rows // group, lk).masked_fill(mask.unsqueeze(2),
                                                                float("-inf"))
        s = s.view(b, hk, rows, lk)
    return s


def _unit_forward(q, k, v, scale, mask, group):
    """(out [b, hk, g·C, d], lse [b, hk, g·C]) of one unit; rows that see nothing get out 0
    and lse -inf (they merge as a no-op)."""
    s = _scores(q, k, scale, mask, group)
    row_max = s.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(s - row_max)
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v) / total.clamp_min(torch.finfo(total.dtype).tiny)
    lse = (row_max + total.log()).squeeze(-1)
    return out, lse


def _merge(out, lse, unit_out, unit_lse):
    """Log-sum-exp merge of a unit's partial result into (out, lse), in place."""
    new_lse = torch.logaddexp(lse, unit_lse)
    finite = torch.isfinite(new_lse)
    safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
    old_w = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(lse))
    new_w = torch.where(finite, torch.exp(unit_lse - safe), torch.zeros_like(lse))
    out.mul_(old_w.unsqueeze(-1)).add_(unit_out * new_w.unsqueeze(-1))
    lse.copy_(new_lse)


def _unit_backward(q, k, v, dout, lse, delta, scale, mask, group):
    """(dq, dk, dv) of one unit given the FINAL out's lse and delta = rowsum(dout·out)."""
    s = _scores(q, k, scale, mask, group)
    p = torch.exp(s - lse.unsqueeze(-1))              # exactly 0 where masked
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return dq, dk, dv


# ---- one step's compute (no communication; also what bench_ring times per rank) ----------------
def forward_step(qg, out, lse, kv, work, scale, group) -> None:
    """Attend the chunked queries qg [2, b, hk, g·C, d] to the block kv [2, 2, b, hk, C, d]
    (chunk, k/v, ...) over `work`, merging into out / lse [2, b, hk, g·C(, d)] in place."""
    with _timed("compute_cpu_s", time.thread_time):
        for unit, m in work:
            unit_out, unit_lse = _unit_forward(qg[unit.q], *_kv_chunk(kv, unit.kv), scale, m,
                                               group)
            _merge(out[unit.q], lse[unit.q], unit_out, unit_lse)
    if _times is not None:
        _times["forward_blocks"] += len(work)


def backward_step(qg, dog, lse, delta, kv, dq, dkv, work, scale, group) -> None:
    """Add this block's share of dq into dq [2, b, hk, g·C, d] and of its dk/dv into the
    travelling accumulator dkv [2, 2, b, hk, C, d], in place."""
    with _timed("compute_cpu_s", time.thread_time):
        for unit, m in work:
            q = unit.q
            dq_u, dk_u, dv_u = _unit_backward(qg[q], *_kv_chunk(kv, unit.kv), dog[q], lse[q],
                                              delta[q], scale, m, group)
            dq[q].add_(dq_u)
            dkv[unit.kv, 0].add_(dk_u)
            dkv[unit.kv, 1].add_(dv_u)


# ---- layout helpers ----------------------------------------------------------------------------
def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types (scores, softmax and the merge need its range), else unchanged."""
    return torch.promote_types(dtype, torch.float32)


def chunked_queries(q: torch.Tensor, hk: int) -> torch.Tensor:
    """[L, b, hq, d] -> [2, b, hk, g·C, d] (fp32 or wider; C = L/2): per local chunk, query
    head i under kv head i // g, so that a chunk's rows are one contiguous tensor."""
    length, b, hq, d = q.shape
    g, c = hq // hk, length // 2
    chunked = q.to(_accumulation_dtype(q.dtype)).view(2, c, b, hk, g, d)
    return chunked.permute(0, 2, 3, 4, 1, 5).reshape(2, b, hk, g * c, d)


def _unchunked(x: torch.Tensor, group: int) -> torch.Tensor:
    """[2, b, hk, g·C, d] -> [L, b, hq, d]."""
    _, b, hk, rows, d = x.shape
    c = rows // group
    return x.view(2, b, hk, group, c, d).permute(0, 4, 1, 2, 3, 5).reshape(2 * c, b, hk * group,
                                                                           d)


def _unpacked(dkv: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[2 chunks, 2 (k, v), b, hk, C, d] -> dk, dv [L, b, hk, d] in `dtype`."""
    _, _, b, hk, c, d = dkv.shape
    both = dkv.permute(1, 0, 4, 2, 3, 5).reshape(2, 2 * c, b, hk, d).to(dtype)
    return both[0], both[1]


def packed_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [L, b, hk, d] -> one contiguous [2 chunks, 2 (k, v), b, hk, C, d] buffer in the
    model's dtype: one message per step (upcast per unit, at compute)."""
    length, b, hk, d = k.shape
    both = torch.stack([k, v]).view(2, 2, length // 2, b, hk, d)     # (k/v, chunk, ...)
    return both.permute(1, 0, 3, 4, 2, 5).contiguous()


def _kv_chunk(kv: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    acc = _accumulation_dtype(kv.dtype)
    return kv[chunk, 0].to(acc), kv[chunk, 1].to(acc)


def _document_ids(documents: DocumentMask) -> torch.Tensor:
    """[b, N] index of each token's document, from the full sequence's cu_seqlens (O(N))."""
    cu = documents.cu_seqlens.long()
    flat = torch.arange(int(cu[-1]), device=cu.device)
    ids = torch.searchsorted(cu[1:], flat, right=True)
    return ids.view(documents.batch_size, -1)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float, plan: _Plan):
        # q [L, b, hq, d]; k, v [L, b, hk, d]
        hk = k.shape[2]
        group = q.shape[2] // hk
        qg = chunked_queries(q, hk)
        kv = packed_kv(k, v)
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:4], float("-inf"), dtype=qg.dtype, device=q.device)
        spare = torch.empty_like(kv)
        for step in range(ring.size):
            pending = ring.start_shift(kv, spare, KV_TAG) if step < ring.size - 1 else []
            src = (ring.rank - step) % ring.size
            forward_step(qg, out, lse, kv, plan.step(src, q.device), scale, group)
            _wait(pending)
            if pending:
                kv, spare = spare, kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.plan = ring, scale, plan
        return _unchunked(out, group).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, plan = ctx.ring, ctx.scale, ctx.plan
        hk = k.shape[2]
        group = q.shape[2] // hk
        qg, dog = chunked_queries(q, hk), chunked_queries(dout, hk)
        delta = (dog * out).sum(-1)                                   # [2, b, hk, g·C]
        kv = packed_kv(k, v)
        spare = torch.empty_like(kv)
        dq = torch.zeros_like(qg)
        # dk/dv accumulators travel in fp32 (or wider): sums of R partial gradients.
        dkv = torch.zeros(kv.shape, dtype=qg.dtype, device=kv.device)
        dkv_in = torch.empty_like(dkv)
        dkv_pending: list = []
        for step in range(ring.size):
            kv_pending = ring.start_shift(kv, spare, KV_TAG) if step < ring.size - 1 else []
            src = (ring.rank - step) % ring.size
            work = plan.step(src, q.device)
            if step > 0:   # the accumulator of src's block, from the previous rank
                _wait(dkv_pending)
                dkv, dkv_in = dkv_in, dkv
            backward_step(qg, dog, lse, delta, kv, dq, dkv, work, scale, group)
            # Pass src's accumulator on (even when no unit touched it); after the last step
            # it reaches its owner.
            dkv_pending = ring.start_shift(dkv, dkv_in, DKV_TAG)
            _wait(kv_pending)
            if kv_pending:
                kv, spare = spare, kv
        _wait(dkv_pending)
        return (_unchunked(dq, group).to(q.dtype), *_unpacked(dkv_in, k.dtype), None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, *,
                   attention_mask: Optional[torch.Tensor] = None, window: Optional[int] = None,
                   softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of this ring rank's local sequence (chunks r and 2R-1-r) against the
    whole sequence. q [L, b, hq, d]; k, v [L, b, hk, d] (hq a multiple of hk); returns
    [L, b, hq, d]. attention_mask: None, the full sequence's DocumentMask, or a dense bool
    [b, 1, N, N] over the full sequence (True = masked). window: query i sees keys
    i-window..i (None: unlimited)."""
    length = q.shape[0]
    if length % 2:
        raise ValueError(f"ring attention needs an even local sequence (two chunks), got {length}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if isinstance(attention_mask, DocumentMask):
        attention_mask = _document_ids(attention_mask)
    plan = _Plan(ring.rank, tuple(ring_chunks(r, ring.size) for r in range(ring.size)),
                 length // 2, window, attention_mask)
    # The unit kernel chooses its own precision (fp32 accumulation for half types): autocast
    # would run the forward's matmuls in bf16 and the backward's (outside autocast) in fp32,
    # and exp(S - lse) would then not be the forward's probabilities.
    with torch.autocast(q.device.type, enabled=False):
        return _RingAttention.apply(q, k, v, ring, scale, plan)
