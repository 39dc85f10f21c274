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
    O(N)). Which units to skip and which to mask is decided on the host from the offsets
    (read once per micro-batch), never by a device sync: a unit is skipped when the first
    query's document starts after the last key, and masked when one document does not cover
    it; masks come from one document id per token.
  A masked unit runs in tiles of MASK_TILE_ROWS query rows with an additive mask [b, 1, T, C],
  so no mask or score tensor is quadratic in C.

Backward is written out as in FlashAttention: with the final out and lse, a unit's
probabilities are exp(S - lse) and D = rowsum(dout·out), so dq accumulates locally while each
k/v block travels around the ring again with its dk/dv accumulator, which takes one last hop
home. Nothing goes through autograd across p2p.

The unit kernels (lse_kernels.py, chosen once per call by backends.RingUnits) are fused
kernels that return the log-sum-exp, in the activation dtype: flash-attn's forward/backward
for whole units where it is installed, torch's memory-efficient kernel on CUDA otherwise (and
for masked units), torch's CPU flash kernel on CPU (fp64 too: the exactness tests use it).
Partial outputs, the log-sum-exp, dq and the travelling dk/dv accumulators are fp32 (fp64 for
fp64). A step's units are blocks of the blocked engine (blocks.py: its merge, bias and
in-place gradients), row ranges of the [L, b, h, d] tensors, so nothing is copied to or from
a blocked layout.
"""

from __future__ import annotations

import bisect
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ...data.sequence_layout import ring_chunks
from ...mpu.comm_stats import record
from ...mpu.parallel_state import ParallelDims
from . import blocks, lse_kernels
from .blocks import Block, Kernels, Mask, MaskRules
from .documents import DocumentMask
from .lse_kernels import UnitKernel

KV_TAG, DKV_TAG = 11, 12  # labels only: NCCL ignores tags, the posting order pairs messages

# Optional time split (benchmarks): CPU seconds in unit kernels, wall seconds blocked on p2p.
_times: dict | None = None


@contextmanager
def measure_ring_time():
    """with measure_ring_time() as t: ... -> t == {"compute_cpu_s": .., "exposed_wait_s": ..,
    "forward_blocks": ..} for this rank: kernel work (thread CPU time, robust to oversubscribed
    cores), the wall time spent waiting for k/v or dk/dv that had not arrived (communication
    not hidden), and how many forward C×C units were computed (excluded ones are skipped)."""
    global _times
    previous, _times = _times, {"compute_cpu_s": 0.0, "exposed_wait_s": 0.0, "forward_blocks": 0}
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

    group: dist.ProcessGroup | None
    rank: int
    size: int
    next_rank: int
    prev_rank: int

    @classmethod
    def from_dims(cls, dims: ParallelDims) -> Ring:
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
        ops = [
            dist.P2POp(dist.isend, send, self.next_rank, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev_rank, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    with _timed("exposed_wait_s", time.perf_counter):
        for r in requests:
            r.wait()


# ---- which C×C units each step computes (decided on the host, once per call) ------------------
# Rows of queries per masked kernel call: the additive mask of one call is [b, 1, T, C], linear
# in C, where a whole unit's mask would be quadratic.
MASK_TILE_ROWS = 512


@dataclass(frozen=True)
class _Unit:
    """Local query chunk `q` (0 or 1) against chunk `kv` (0 or 1) of the arriving block; `i`
    and `j` are their global chunk indices. `masked`: the window or the documents cut through
    the unit (a bias per tile of rows), else the kernel's own causal flag (i == j) or nothing."""

    q: int
    kv: int
    i: int
    j: int
    masked: bool = False


@dataclass(frozen=True)
class DocumentSpans:
    """Document starts per sample (host, from the micro-batch's offsets: one device->host copy
    per micro-batch) and each token's document id [b, N] on the device (for masks)."""

    starts: tuple[tuple[int, ...], ...]
    length: int
    ids: torch.Tensor

    @classmethod
    def of(cls, documents: DocumentMask) -> DocumentSpans:
        n = documents.seq_length
        starts: list[list[int]] = [[] for _ in range(documents.batch_size)]
        for offset in documents.offsets[:-1]:
            sample, position = divmod(offset, n)
            starts[sample].append(position)
        return cls(tuple(tuple(s) for s in starts), n, documents.token_documents())

    def span(self, sample: int, position: int) -> tuple[int, int]:
        """[start, end) of the document holding `position` in `sample`."""
        starts = self.starts[sample]
        k = bisect.bisect_right(starts, position) - 1
        return starts[k], starts[k + 1] if k + 1 < len(starts) else self.length


def _unit(
    q: int,
    kv: int,
    i: int,
    j: int,
    chunk: int,
    window: int | None,
    documents: DocumentSpans | None,
) -> _Unit | None:
    """The unit, or None when causality, the window or the documents exclude all of it.
    Relative position of query a vs key b in a unit: (i - j)·C + a - b; its smallest value is
    (i - j)·C - (C - 1), between the unit's first query and last key."""
    if j > i:
        return None  # the keys are in the future
    offset = (i - j) * chunk
    if window is not None and offset - (chunk - 1) > window:
        return None  # every key is beyond the window
    masked = window is not None and offset + chunk - 1 > window
    if documents is not None:
        samples = range(len(documents.starts))
        # The first query's document holds the closest pair; if it starts after the last key,
        # no query of the unit shares a document with any key.
        if j < i and all(documents.span(s, i * chunk)[0] >= (j + 1) * chunk for s in samples):
            return None
        masked = masked or any(documents.span(s, j * chunk)[1] < (i + 1) * chunk for s in samples)
    return _Unit(q, kv, i, j, masked)


def _units(
    q_chunks: tuple[int, int],
    kv_chunks: tuple[int, int],
    chunk: int,
    window: int | None,
    documents: DocumentSpans | None = None,
) -> list[_Unit]:
    """The units of one step that causality, the window and the documents do not exclude,
    query-chunk major."""
    units = [
        _unit(q, kv, i, j, chunk, window, documents)
        for q, i in enumerate(q_chunks)
        for kv, j in enumerate(kv_chunks)
    ]
    return [u for u in units if u is not None]


@dataclass(frozen=True)
class RingPlan:
    """What one rank computes: the global chunks of each ring rank, C, window, documents and
    the unit kernels (`dense` for unmasked units, `masked` for those that take a bias)."""

    rank: int
    chunks: tuple[tuple[int, int], ...]  # per ring rank
    chunk: int
    window: int | None
    documents: DocumentSpans | None
    dense: UnitKernel = lse_kernels.CPU_FLASH
    masked: UnitKernel = lse_kernels.CPU_FLASH

    def step(self, src: int) -> list[_Unit]:
        """The units to compute against src's block (host arithmetic only, no device sync)."""
        return _units(
            self.chunks[self.rank], self.chunks[src], self.chunk, self.window, self.documents
        )

    def tiles(self, unit: _Unit) -> list[tuple[int, int]]:
        """Query row ranges [r0, r1) of the kernel calls for `unit`."""
        if not unit.masked:
            return [(0, self.chunk)]
        return [
            (r, min(r + MASK_TILE_ROWS, self.chunk)) for r in range(0, self.chunk, MASK_TILE_ROWS)
        ]

    def blocks(self, unit: _Unit) -> list[Block]:
        """The engine's blocks of `unit`: rows of the local queries (chunk `unit.q`) against
        the arriving block's chunk `unit.kv`, at their global positions (for the bias)."""
        c = self.chunk
        mask = Mask.BIAS if unit.masked else Mask.CAUSAL if unit.i == unit.j else Mask.FULL
        return [
            Block(
                unit.q * c + r0,
                unit.q * c + r1,
                unit.kv * c,
                (unit.kv + 1) * c,
                mask,
                q_at=unit.i * c + r0,
                k_at=unit.j * c,
            )
            for r0, r1 in self.tiles(unit)
        ]

    def step_blocks(self, src: int) -> tuple[list[Block], int]:
        work = self.step(src)
        return _plan_blocks(self, work), len(work)

    @property
    def rules(self) -> MaskRules:
        return MaskRules(self.window, None if self.documents is None else self.documents.ids)

    @property
    def kernels(self) -> Kernels:
        return Kernels(self.dense, self.masked)


def _plan_blocks(plan: RingPlan, work: list[_Unit]) -> list[Block]:
    return [block for unit in work for block in plan.blocks(unit)]


class StepPlan(Protocol):
    """What a ring step computes against one source rank's block: the engine's blocks (rows of
    the local sequence against rows of the arriving block, at their global positions), with
    the plan's mask rules and unit kernels. RingPlan (dense causal) and the block-sparse ring
    plan (block_sparse_ring.py) are two."""

    @property
    def rules(self) -> MaskRules: ...

    @property
    def kernels(self) -> Kernels: ...

    def step_blocks(self, src: int) -> tuple[list[Block], int]:
        """The blocks against src's block and how many C×C units they cover."""
        ...


# ---- one step's compute (no communication; also what bench_ring times per rank) ----------------
def forward_step(q, out, lse, kv, src: int, scale, plan: StepPlan) -> None:
    """Attend the local queries q [L, b, hq, d] to src's block kv [2 (k, v), L, b, hk, d],
    merging into out [L, b, hq, d] and lse [b, hq, L] (fp32 or wider) in place."""
    work, units = plan.step_blocks(src)
    with _timed("compute_cpu_s", time.thread_time):
        blocks.forward(q, kv[0], kv[1], out, lse, work, plan.kernels, plan.rules, scale)
    if _times is not None:
        _times["forward_blocks"] += units


def backward_step(q, dout, out, lse, kv, dq, dkv, src: int, scale, plan: StepPlan) -> None:
    """Add src's block's share of dq into dq [L, b, hq, d] and of its dk/dv into the travelling
    accumulator dkv [2 (k, v), L, b, hk, d] (fp32 or wider), in place; out and lse are the
    final (merged) output and log-sum-exp."""
    work, _ = plan.step_blocks(src)
    with _timed("compute_cpu_s", time.thread_time):
        blocks.backward(
            dout, q, kv[0], kv[1], out, lse, dq, dkv[0], dkv[1], work, plan.kernels,
            plan.rules, scale,
        )  # fmt: skip


# ---- layout helpers ------------------------------------------------------------------------
def packed_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [L, b, hk, d] -> one contiguous [2 (k, v), L, b, hk, d] buffer in the model's
    dtype: one message per step."""
    return torch.stack([k, v])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float, plan: StepPlan):
        # q [L, b, hq, d]; k, v [L, b, hk, d]
        kv = packed_kv(k, v)
        # partial outputs and log-sum-exp merge in fp32 (fp64 for fp64)
        out = torch.zeros(q.shape, dtype=lse_kernels.lse_dtype(q.dtype), device=q.device)
        lse = torch.full(
            (q.shape[1], q.shape[2], q.shape[0]), float("-inf"), dtype=out.dtype, device=q.device
        )  # [b, hq, L]
        spare = torch.empty_like(kv)
        for step in range(ring.size):
            pending = ring.start_shift(kv, spare, KV_TAG) if step < ring.size - 1 else []
            src = (ring.rank - step) % ring.size
            forward_step(q, out, lse, kv, src, scale, plan)
            _wait(pending)
            if pending:
                kv, spare = spare, kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.plan = ring, scale, plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, plan = ctx.ring, ctx.scale, ctx.plan
        dout = dout.to(q.dtype)
        kv = packed_kv(k, v)
        spare = torch.empty_like(kv)
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        # dk/dv accumulators travel in fp32 (or wider): sums of R partial gradients.
        dkv = torch.zeros(kv.shape, dtype=lse.dtype, device=kv.device)
        dkv_in = torch.empty_like(dkv)
        dkv_pending: list = []
        for step in range(ring.size):
            kv_pending = ring.start_shift(kv, spare, KV_TAG) if step < ring.size - 1 else []
            src = (ring.rank - step) % ring.size
            if step > 0:  # the accumulator of src's block, from the previous rank
                _wait(dkv_pending)
                dkv, dkv_in = dkv_in, dkv
            backward_step(q, dout, out, lse, kv, dq, dkv, src, scale, plan)
            # Pass src's accumulator on (even when no unit touched it); after the last step
            # it reaches its owner.
            dkv_pending = ring.start_shift(dkv, dkv_in, DKV_TAG)
            _wait(kv_pending)
            if kv_pending:
                kv, spare = spare, kv
        _wait(dkv_pending)
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None, None


def ring_plan(
    ring: Ring,
    length: int,
    *,
    dense: UnitKernel = lse_kernels.CPU_FLASH,
    masked: UnitKernel = lse_kernels.CPU_FLASH,
    window: int | None = None,
    documents: DocumentMask | None = None,
) -> RingPlan:
    """This rank's plan: its units, run on the unit kernels the selection chose."""
    if length % 2:
        raise ValueError(f"ring attention needs an even local sequence (two chunks), got {length}")
    return RingPlan(
        ring.rank,
        tuple(ring_chunks(r, ring.size) for r in range(ring.size)),
        length // 2,
        window,
        None if documents is None else DocumentSpans.of(documents),
        dense,
        masked,
    )


def run_ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: Ring,
    dense: UnitKernel,
    masked: UnitKernel,
    *,
    window: int | None,
    documents: DocumentMask | None,
    scale: float,
) -> torch.Tensor:
    """Causal attention of this ring rank's local sequence (chunks r and 2R-1-r) against the
    whole sequence, on the given unit kernels. q [L, b, hq, d]; k, v [L, b, hk, d] (hq a
    multiple of hk); returns [L, b, hq, d] in q's dtype. documents: the full sequence's
    DocumentMask. window: query i sees keys i-window..i (None: unlimited)."""
    plan = ring_plan(
        ring, q.shape[0], dense=dense, masked=masked, window=window, documents=documents
    )
    return _RingAttention.apply(q, k, v, ring, scale, plan)


def run_ring_plan(q, k, v, ring: Ring, plan: StepPlan, scale: float) -> torch.Tensor:
    """The ring's communication around any step plan: q [L, b, hq, d]; k, v [L, b, hk, d];
    returns [L, b, hq, d] in q's dtype."""
    return _RingAttention.apply(q, k, v, ring, scale, plan)
