"""The attention rows of tools/gpu_check.py: every attention path through the model's own
attention core (model/ulysses.DistributedAttention, which dispatches to the kernels), checked
against attention written out densely in fp64, and ring attention run as R virtual ranks in
one process.

Virtual ranks: a ring rank's forward and backward block on messages from the previous rank,
and all R ranks share one device here, so they cannot run side by side (NCCL refuses two ranks
on one GPU; autograd runs a GPU graph's backward on one device thread). Instead each rank runs
alone, in rank order, and its k-th receive is the previous rank's k-th send (NCCL's rule: one
communicator's messages match in issue order, tags ignored): sent in this pass when that rank
has already run, else recorded in the previous pass (zeros in the first). The passes repeat
until every rank's output and gradients are bitwise those of the previous pass: a fixpoint is
the ring's exact result, since each message then equals what the real ring would carry.
A last pass replays the fixpoint's messages without recording, to time each rank and measure
its memory alone. Communication itself is not exercised (one GPU cannot show it)."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from megatron_ul.data.sequence_layout import rank_positions
from megatron_ul.model.attention import document_tiles as tiles_module
from megatron_ul.model.attention import lse_kernels
from megatron_ul.model.attention.backends import attention_kernel
from megatron_ul.model.attention.dispatch import AttentionCall
from megatron_ul.model.attention.document_tiles import tiled_document_attention
from megatron_ul.model.attention.documents import DocumentMask
from megatron_ul.model.attention.layer import LayerAttention
from megatron_ul.model.attention.ring import Ring
from megatron_ul.model.attention.ulysses import DistributedAttention
from megatron_ul.mpu.random import MODEL_PARALLEL_RNG, get_rng_tracker
from tools.gpu_check_sdpa import DIRECT_OPS

HALF_OUT_TOLERANCE = 2e-2  # as tests/model/test_ring_attention.py (bf16)
HALF_GRAD_TOLERANCE = 5e-2  # as tests/model/test_document_attention.py (bf16 gradients)
FP32_TOLERANCE = 1e-5  # the project's fp32 bar
MIB = 2**20


@dataclass(frozen=True)
class Case:
    name: str
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    documents: int = 0  # documents in the sequence (0: none)
    window: int | None = None

    def bounds(self) -> tuple[float, float]:
        if self.dtype == torch.float32:
            return FP32_TOLERANCE, FP32_TOLERANCE
        return HALF_OUT_TOLERANCE, HALF_GRAD_TOLERANCE


def inputs(case: Case, device: str, seed: int = 0):
    """q, k, v, dout [N, 1, h, d] in the case's dtype, and the DocumentMask (or None). Also
    seeds the attention-dropout stream the core forks (as a one-rank training run does)."""
    tracker = get_rng_tracker()
    tracker.reset(device)
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718)
    g = torch.Generator(device="cpu").manual_seed(seed)
    shapes = [
        (case.seq, 1, case.heads, case.head_dim),
        (case.seq, 1, case.kv_heads, case.head_dim),
        (case.seq, 1, case.kv_heads, case.head_dim),
        (case.seq, 1, case.heads, case.head_dim),
    ]
    q, k, v, dout = (torch.randn(s, generator=g).to(device, case.dtype) for s in shapes)
    documents = None
    if case.documents > 1:
        starts = torch.randperm(case.seq - 1, generator=g)[: case.documents - 1] + 1
        cu = torch.cat([torch.tensor([0]), starts.sort().values, torch.tensor([case.seq])])
        documents = DocumentMask(cu.to(device, torch.int32), 1)
    return q, k, v, dout, documents


def dense_reference(q, k, v, dout, documents: DocumentMask | None, window: int | None):
    """(out, dq, dk, dv) of causal attention written out in fp64 with an explicit mask."""
    n, _, hq, d = q.shape
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = hq // k.shape[2]
    kk, vv = (t.repeat_interleave(group, dim=2) for t in (k64, v64))
    pos = torch.arange(n, device=q.device)
    allowed = pos.unsqueeze(1) >= pos.unsqueeze(0)
    if window is not None:
        allowed &= pos.unsqueeze(1) - pos.unsqueeze(0) <= window
    if documents is not None:
        doc = torch.zeros(n, dtype=torch.long, device=q.device)
        doc[documents.cu_seqlens[1:-1].long()] = 1
        doc = doc.cumsum(0)
        allowed &= doc.unsqueeze(1) == doc.unsqueeze(0)
    scores = torch.einsum("qbhd,kbhd->bhqk", q64, kk) / d**0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,kbhd->qbhd", probs, vv)
    out.backward(dout.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (a scale-free error for outputs and gradients alike)."""
    scale = ref.double().abs().max().clamp_min(1e-30)
    return float((a.double() - ref.double()).abs().max() / scale)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@dataclass
class Measured:
    results: tuple  # out, dq, dk, dv
    seconds: float
    working_mib: float | None  # CUDA: peak allocated above what was allocated before


def fused_kernels_only(device: str):
    """On CUDA, SDPA may use its flash, memory-efficient or cuDNN kernels but not the math
    kernel (O(N²) memory): a call that only the math kernel takes raises instead."""
    if device != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    )


def forward_backward(
    core, q, k, v, dout, documents, device: str, fused_only: bool = True
) -> Measured:
    """One forward + backward of an attention core on leaf copies of q, k, v (on CUDA with
    SDPA's math kernel refused unless fused_only is False)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    _sync(device)
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with fused_kernels_only(device) if fused_only else nullcontext():
        out = core(*leaves, dropout_p=0.0, documents=documents)
        out.backward(dout)
    _sync(device)
    seconds = time.perf_counter() - start
    working = (torch.cuda.max_memory_allocated() - before) / MIB if device == "cuda" else None
    return Measured((out.detach(), *(t.grad for t in leaves)), seconds, working)


def one_device(
    case: Case,
    q,
    k,
    v,
    dout,
    documents,
    device: str,
    repeats: int = 2,
    fused_only: bool = True,
    recorder: Any = None,
) -> Measured:
    """The attention core on one device (no Ulysses, no ring); the last of `repeats` runs is
    returned, the first is recorded by `recorder` (an SdpaRecorder) if given."""
    core = DistributedAttention(1, LayerAttention(window=case.window), None)
    for i in range(repeats):
        with recorder if (recorder is not None and i == 0) else nullcontext():
            run = forward_backward(core, q, k, v, dout, documents, device, fused_only)
    return run


def kernel_of(case: Case, device: str, ring: bool = False, dropout: bool = False) -> str:
    """The kernel attention_dispatch decides for the case (our dispatch's own claim, for the
    note; the kernel column records what ran)."""
    call = AttentionCall(
        torch.device(device),
        case.dtype,
        case.head_dim,
        case.heads,
        case.kv_heads,
        case.documents > 0,
        case.window,
        ring,
        dropout=dropout,
    )
    return attention_kernel(call)


def errors(results, reference) -> tuple[float, float]:
    """(output error, worst gradient error), each relative to the reference's largest entry."""
    out = relative_error(results[0], reference[0])
    return out, max(relative_error(a, b) for a, b in zip(results[1:], reference[1:]))


# ---- ring attention on virtual ranks --------------------------------------------------------
class _Completed:
    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class VirtualLinks:
    """The messages of one pass over R virtual ranks (see the module docstring)."""

    def __init__(self, size: int):
        self.size = size
        self.current: list[list[torch.Tensor]] = [[] for _ in range(size)]
        self.previous: list[list[torch.Tensor]] = [[] for _ in range(size)]
        self.received = [0] * size
        self.finished: set[int] = set()
        self.replay = False

    def new_pass(self, replay: bool = False) -> None:
        if not self.replay:
            self.previous = self.current
        self.current = [[] for _ in range(self.size)]
        self.received = [0] * self.size
        self.finished = set()
        self.replay = replay

    def shift(self, rank: int, prev: int, send: torch.Tensor, recv: torch.Tensor) -> list:
        if not self.replay:
            self.current[rank].append(send.detach().clone())
        index = self.received[rank]
        self.received[rank] += 1
        source = (
            self.current[prev] if prev in self.finished and not self.replay else self.previous[prev]
        )
        if index < len(source):
            message = source[index]
            if message.shape != recv.shape or message.dtype != recv.dtype:
                raise RuntimeError(
                    f"virtual ring: rank {rank}'s receive #{index} from rank {prev} is "
                    f"{tuple(recv.shape)} {recv.dtype}, the matching send was "
                    f"{tuple(message.shape)} {message.dtype} (messages match in issue order)"
                )
            recv.copy_(message)
        else:
            recv.zero_()
        return [_Completed()]


@dataclass(frozen=True)
class VirtualRing(Ring):
    """A Ring whose exchange goes through VirtualLinks instead of a process group."""

    links: Any = None

    def start_shift(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> list:
        return self.links.shift(self.rank, self.prev_rank, send, recv)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@dataclass
class RingRun:
    results: tuple  # out, dq, dk, dv over the full sequence (scattered back)
    passes: int
    converged: bool
    seconds: float  # slowest rank, forward + backward
    working_mib: float | None  # largest rank's, CUDA only


def virtual_ring(
    case: Case, size: int, q, k, v, dout, documents, device: str, recorder: Any = None
) -> RingRun:
    """Ring attention over `size` virtual ranks of the full-sequence q, k, v; the first pass
    recorded by `recorder` (an SdpaRecorder) if given."""
    positions = [rank_positions(case.seq, 0, 1, r, size).to(q.device) for r in range(size)]
    links = VirtualLinks(size)

    def one_pass():
        per_rank = []
        for r in range(size):
            ring = VirtualRing(
                group=None,
                rank=r,
                size=size,
                next_rank=(r + 1) % size,
                prev_rank=(r - 1) % size,
                links=links,
            )
            core = DistributedAttention(1, LayerAttention(window=case.window, ring=ring), None)
            p = positions[r]
            per_rank.append(forward_backward(core, q[p], k[p], v[p], dout[p], documents, device))
            links.finished.add(r)
        return per_rank

    previous, passes, converged = None, 0, False
    while not converged and passes < 2 * size + 1:
        links.new_pass()
        with recorder if (recorder is not None and passes == 0) else nullcontext():
            runs = one_pass()
        passes += 1
        converged = previous is not None and _same(
            [m.results for m in runs], [m.results for m in previous]
        )
        previous = runs
    assert previous is not None  # the loop above ran at least once
    links.new_pass(replay=True)
    runs = one_pass()
    converged &= _same([m.results for m in runs], [m.results for m in previous])
    full = [torch.empty_like(t) for t in (q, k, v)]
    out = torch.empty_like(q)
    for p, m in zip(positions, runs):
        out[p] = m.results[0]
        for buffer, grad in zip(full, m.results[1:]):
            buffer[p] = grad
    working = [m.working_mib for m in runs]
    return RingRun(
        (out, *full),
        passes,
        converged,
        max(m.seconds for m in runs),
        max(working) if working[0] is not None else None,
    )


# ---- torch's efficient kernel called directly: the ring's units and the document tiles -------
@contextmanager
def efficient_kernel_ops(device: str, recorder: Any):
    """Yields a note on what computes lse_kernels' efficient-kernel calls: torch's own CUDA ops
    on a GPU; in the CPU mode the suite's CPU stand-in of those ops (tests/stand_ins), its
    calls counted into `recorder`; None where neither is available."""
    if device == "cuda":
        yield "torch's CUDA kernel"
        return
    try:
        from tests.stand_ins.sdpa_efficient_cuda import EfficientOps
    except ImportError:
        yield None
        return
    ops = EfficientOps()
    original = lse_kernels.cuda_ops
    # patched on purpose: the stand-in's ops, counted, in place of the CUDA ones
    lse_kernels.cuda_ops = _CountedOps(ops, recorder)  # type: ignore[assignment]
    try:
        yield "CPU stand-in (tests/stand_ins/sdpa_efficient_cuda.py)"
    finally:
        lse_kernels.cuda_ops = original


class _CountedOps:
    """Forwards to a stand-in's ops, counting each call as the recorder counts a real one."""

    def __init__(self, ops: Any, recorder: Any):
        self.ops, self.recorder = ops, recorder

    def __getattr__(self, name: str):
        fn = getattr(self.ops, name)

        def counted(*args, **kwargs):
            if name in DIRECT_OPS:
                self.recorder.add(f"{DIRECT_OPS[name]} (direct, stand-in)")
            return fn(*args, **kwargs)

        return counted


def heads_first_view(seq: int, heads: int, head_dim: int, dtype, device, g) -> torch.Tensor:
    """[1, h, S, d] as the ring's chunk views and the tiles' _heads_first hand it to a kernel:
    a transposed view of a [S, 1, h, d] buffer (rows h·d apart, heads d apart)."""
    base = torch.randn(seq, 1, heads, head_dim, generator=g).to(device, dtype)
    return base.permute(1, 2, 0, 3)


def _unit_bias(seq: int, dtype, device) -> torch.Tensor:
    """A masked unit's bias [1, 1, S, S]: causal within three documents, rows padded to
    lse_kernels.BIAS_ALIGN as the ring and the tiles pad them."""
    pos = torch.arange(seq, device=device)
    doc = (pos >= seq // 3).long() + (pos >= (2 * seq) // 3).long()
    visible = (pos.unsqueeze(1) >= pos.unsqueeze(0)) & (doc.unsqueeze(1) == doc.unsqueeze(0))
    width = -(-seq // lse_kernels.BIAS_ALIGN) * lse_kernels.BIAS_ALIGN
    bias = torch.zeros(1, 1, seq, width, dtype=dtype, device=device)[..., :seq]
    return bias.masked_fill_(~visible, float("-inf"))


def unit_reference(q, k, v, dout, causal: bool, bias, scale: float):
    """(out, dq, dk, dv) of one unit written out in fp64 ([b, h, S, d]; kv heads repeated)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, dim=1) for t in (k64, v64))
    s = q64 @ kk.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.double()
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    out = s.softmax(-1) @ vv
    out.backward(dout.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def efficient_unit(kind: str, seq: int, heads: tuple, dtype, device: str, seed: int = 0):
    """One ring unit through lse_kernels.SDPA_EFFICIENT, forward then backward with the final
    out and lse, as the ring runs it: kind 'causal' (a diagonal unit), 'full' (an earlier
    block) or 'masked' (a bias: documents cut through the unit). Returns (results, reference,
    seconds)."""
    hq, hk, d = heads
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (heads_first_view(seq, h, d, dtype, device, g) for h in (hq, hk, hk, hq))
    causal, bias = kind == "causal", _unit_bias(seq, dtype, device) if kind == "masked" else None
    scale = d**-0.5
    kernel = lse_kernels.SDPA_EFFICIENT
    _sync(device)
    start = time.perf_counter()
    out, lse = kernel.forward(q, k, v, causal, bias, scale)
    # the callers merge into their own [S, b, h, d] buffer and hand backward a view of it
    out_view = torch.empty(seq, 1, hq, d, dtype=dtype, device=device).permute(1, 2, 0, 3)
    out_view.copy_(out)
    dq, dk, dv = kernel.backward(dout, q, k, v, out_view, lse, causal, bias, scale)
    _sync(device)
    seconds = time.perf_counter() - start
    reference = unit_reference(q, k, v, dout, causal, bias, scale)
    return (out, dq, dk, dv), reference, seconds


def efficient_tiles(case: Case, device: str):
    """Documents and a window through the document tiles on lse_kernels.SDPA_EFFICIENT,
    forward + backward; returns (results, reference, seconds)."""
    q, k, v, dout, documents = inputs(case, device)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    _sync(device)
    start = time.perf_counter()
    ql, kl, vl = leaves
    out = tiled_document_attention(
        ql, kl, vl, documents, case.window, None, lse_kernels.SDPA_EFFICIENT
    )
    out.backward(dout)
    _sync(device)
    seconds = time.perf_counter() - start
    reference = dense_reference(q, k, v, dout, documents, case.window)
    return (out.detach(), *(t.grad for t in leaves)), reference, seconds


# ---- attention dropout: the mask read back from the output -----------------------------------
DROPOUT_RATE_SIGMAS = 6.0  # the dropped fraction's bound, in binomial standard deviations
# flash-attn's kernels compare an 8-bit random number with an 8-bit keep threshold: the
# dropped fraction may sit up to 1/256 off p
DROPOUT_QUANTUM = 1 / 256
# The same seed redraws the same mask: outputs bitwise; gradients bitwise up to the order of a
# backward kernel's atomic accumulation (about one bf16 rounding of the largest entry)
SAME_SEED_GRAD_TOLERANCE = 1e-2


@dataclass
class DropoutRun:
    out: torch.Tensor
    grads: tuple


def dropout_inputs(case: Case, device: str, seed: int = 0):
    """q, k, dout random; v the identity over the sequence (v[j] = e_j: the case's head dim is
    at least its length), so that out[i] is row i of the dropped, rescaled probabilities and
    the mask the kernel drew can be read back: out[i, j] == 0 exactly where key j was dropped
    (or is not visible)."""
    q, k, _, dout, documents = inputs(case, device, seed)
    if case.head_dim < case.seq:
        raise ValueError(f"{case.name}: head dim {case.head_dim} < sequence {case.seq}")
    v = torch.zeros(case.seq, 1, case.kv_heads, case.head_dim)
    index = torch.arange(case.seq)
    v[index, 0, :, index] = 1.0
    return q, k, v.to(device, case.dtype), dout, documents


def dropout_run(
    case: Case, q, k, v, dout, documents, device: str, p: float, seed: int, tiles: bool = False
):
    """Forward + backward with attention dropout p: through the model's attention core, the
    dropout stream seeded with `seed` as a one-rank training run seeds it; or (tiles) straight
    through the document tiles on torch's efficient kernel, several tiles per sequence, the
    device's generator (where the kernel draws its philox seed) seeded with `seed`."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if tiles:
        torch.manual_seed(seed)
        if device == "cuda":
            torch.cuda.manual_seed(seed)
        ql, kl, vl = leaves
        with tile_size(max(case.seq // 4, 8)):
            out = tiled_document_attention(
                ql, kl, vl, documents, case.window, None, lse_kernels.SDPA_EFFICIENT, dropout_p=p
            )
    else:
        tracker = get_rng_tracker()
        tracker.reset(device)
        tracker.add(MODEL_PARALLEL_RNG, seed)
        core = DistributedAttention(1, LayerAttention(window=case.window), None)
        out = core(*leaves, dropout_p=p, documents=documents)
    out.backward(dout)
    return DropoutRun(out.detach(), tuple(t.grad for t in leaves))


@contextmanager
def tile_size(tokens: int):
    """The document tiles' query tile (read at call time) set to `tokens` for a while."""
    original = tiles_module.TILE
    tiles_module.TILE = tokens
    try:
        yield
    finally:
        tiles_module.TILE = original


def visible_keys(case: Case, documents, device: str) -> torch.Tensor:
    """[N (queries), N (keys)] bool: causal, within the window and the document."""
    n = case.seq
    pos = torch.arange(n, device=device)
    allowed = pos.unsqueeze(1) >= pos.unsqueeze(0)
    if case.window is not None:
        allowed &= pos.unsqueeze(1) - pos.unsqueeze(0) <= case.window
    if documents is not None:
        doc = torch.zeros(n, dtype=torch.long, device=device)
        doc[documents.cu_seqlens[1:-1].long()] = 1
        doc = doc.cumsum(0)
        allowed &= doc.unsqueeze(1) == doc.unsqueeze(0)
    return allowed


def masked_reference(q, k, v, dout, allowed, kept, p: float):
    """(out, dq, dk, dv) in fp64 of attention whose probabilities are multiplied by the kept
    mask / (1 - p) (kept [b, h, N, N], the mask the kernel drew), by autograd."""
    n, _, hq, d = q.shape
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = hq // k.shape[2]
    kk, vv = (t.repeat_interleave(group, dim=2) for t in (k64, v64))
    scores = torch.einsum("qbhd,kbhd->bhqk", q64, kk) / d**0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    dropped = probs * kept.double() / (1.0 - p)
    out = torch.einsum("bhqk,kbhd->qbhd", dropped, vv)
    out.backward(dout.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


@dataclass
class DropoutCheck:
    dropped: float  # fraction of visible (query, key) pairs dropped
    rate_bound: float  # |dropped - p| allowed
    leaked: int  # non-zero probabilities outside the visible keys
    same_seed_out_equal: bool  # the same seed twice: the output bitwise
    same_seed_grad_diff: float  # ... and the gradients' largest relative difference
    other_seed_differs: bool  # another seed: another mask
    out_error: float
    grad_error: float


def dropout_check(case: Case, device: str, p: float, tiles: bool = False) -> DropoutCheck:
    """Attention dropout p through the model's core (or the tiles), against fp64 with the
    mask it drew."""
    q, k, v, dout, documents = dropout_inputs(case, device)
    first, again, other = (
        dropout_run(case, q, k, v, dout, documents, device, p, seed, tiles)
        for seed in (1234, 1234, 4321)
    )
    grad_diff = max(relative_error(a, b) for a, b in zip(again.grads, first.grads))
    # out [N, 1, hq, d] -> [1, hq, N (queries), N (keys)]: the kept probabilities
    probs = first.out[..., : case.seq].permute(1, 2, 0, 3)
    allowed = visible_keys(case, documents, device)
    kept = (probs != 0) & allowed
    visible = int(allowed.sum()) * case.heads
    dropped = 1.0 - float(kept.sum()) / visible
    leaked = int(((probs != 0) & ~allowed).sum())
    reference = masked_reference(q, k, v, dout, allowed, kept, p)
    out_err, grad_err = errors((first.out, *first.grads), reference)
    return DropoutCheck(
        dropped,
        DROPOUT_RATE_SIGMAS * (p * (1 - p) / visible) ** 0.5 + DROPOUT_QUANTUM,
        leaked,
        torch.equal(first.out, again.out),
        grad_diff,
        not torch.equal(first.out, other.out),
        out_err,
        grad_err,
    )
