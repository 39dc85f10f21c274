#!/usr/bin/env python
"""Ulysses (U = P), ring (R = P) and hybrid (U × R = P) sequence parallelism side by side.

1. Bytes one rank sends in one transformer layer, forward and backward (mpu/comm_stats.py),
   next to the formulas, in units of N·h elements (MHA, kv heads = heads):
     Ulysses all-to-all on the N/R tokens of a ring rank: 4·(N/R)·h/U · (U-1)/U
     ring, forward: each k/v block (2·(N/R)·h/U) travels R-1 hops:          2·N·h·(R-1)/(R·U)
     ring, backward: k/v again R-1 hops, plus dk/dv (fp32) R hops:          2·N·h·(2R-1)/(R·U)
2. Time split of the attention core (forward + backward) per rank on CPU: wall time, attention
   compute, exposed communication (all-to-all time + time blocked waiting for ring blocks).
3. The ring's causal load balance: each ring rank's compute (forward + backward, the module's
   own step functions) run alone, rank after rank, in one process; max/min over ranks.

4. Peak memory of the attention call per rank as the local sequence doubles, ring against
   Ulysses alone at the same tokens per rank (torch's profiler, every allocation and free).

    python -m tools.bench.bench_ring [--seq-length 4096 --hidden-size 512] [--write-docs]
"""

import argparse
import random
import time

import torch
import torch.distributed as dist

from megatron_ul.data.sequence_layout import ring_chunks
from megatron_ul.model.attention import ring as ring_attention
from megatron_ul.model.attention.layer import LayerAttention
from megatron_ul.model.attention.ring import Ring, measure_ring_time
from megatron_ul.model.attention.ulysses import DistributedAttention
from megatron_ul.mpu import parallel_state as ps
from megatron_ul.mpu.random import model_parallel_seed
from megatron_ul.timers import Timers
from tools.bench.bench_comm_volume import layer_bytes
from tools.bench.common import markdown_table, report, run_ranks

MIB = 2**20


def _layouts(p: int) -> list[tuple[int, int]]:
    """(U, R) with U·R = P: pure Ulysses, every hybrid, pure ring."""
    return [(u, p // u) for u in sorted((d for d in range(1, p + 1) if p % d == 0), reverse=True)]


def _name(u: int, r: int) -> str:
    return "Ulysses" if r == 1 else "ring" if u == 1 else "hybrid"


def one_layer_bytes(rank, world, seq, hidden, heads, u, r):
    dims = ps.initialize_model_parallel(1, u, 1, context_parallel_size=r)
    return layer_bytes(dims, world, seq, hidden, heads)


def formula_nh(u: int, r: int) -> tuple[float, float]:
    """(forward, backward) bytes per rank per layer in units of N·h elements."""
    ulysses = 4 * (u - 1) / (r * u * u)
    if r == 1:
        return ulysses, ulysses
    return ulysses + 2 * (r - 1) / (r * u), ulysses + 2 * (2 * r - 1) / (r * u)


def table_bytes(seq: int, hidden: int, heads: int, sizes: list[int]) -> str:
    rows, unit = [], seq * hidden * 4
    for p in sizes:
        for u, r in _layouts(p):
            if heads % u:
                continue
            fwd, bwd = run_ranks(one_layer_bytes, p, seq, hidden, heads, u, r)[0]
            f_nh, b_nh = formula_nh(u, r)
            rows.append(
                [
                    p,
                    f"{_name(u, r)} U{u}×R{r}",
                    f"{fwd.get('all_to_all', 0) / MIB:.2f}",
                    f"{fwd.get('p2p', 0) / MIB:.2f}",
                    f"{sum(fwd.values()) / MIB:.2f}",
                    f"{f_nh * unit / MIB:.2f}",
                    f"{sum(bwd.values()) / MIB:.2f}",
                    f"{b_nh * unit / MIB:.2f}",
                    f"{f_nh:.3f}·Nh",
                ]
            )
    return markdown_table(
        [
            "P",
            "layout",
            "fwd all-to-all MiB",
            "fwd p2p MiB",
            "fwd MiB",
            "fwd formula MiB",
            "bwd MiB",
            "bwd formula MiB",
            "fwd formula",
        ],
        rows,
    )


def attention_time(rank, world, seq, heads, head_dim, u, r, warmup, iters):
    """Per iteration: (wall s, exposed comm s, ring kernel CPU s) of the attention core; the
    kernel time is the fastest iteration's (other jobs on a shared machine only add to it)."""
    dims = ps.initialize_model_parallel(1, u, 1, context_parallel_size=r)
    model_parallel_seed(1, dims, "cpu")
    timers = Timers(1)  # times the Ulysses all-to-alls
    core = DistributedAttention(
        u, LayerAttention(ring=Ring.from_dims(dims)), dims.sp_group, timers=timers
    )
    g = torch.Generator().manual_seed(rank)
    q, k, v = (
        torch.randn(seq // world, 1, heads, head_dim, generator=g).requires_grad_()
        for _ in range(3)
    )
    wall, kernel = 0.0, []
    with measure_ring_time() as ring_times:
        for i in range(warmup + iters):
            if i == warmup:
                timers.pop()
                wall = 0.0
                ring_times.update(exposed_wait_s=0.0)
            ring_times.update(compute_cpu_s=0.0)
            dist.barrier()
            start = time.perf_counter()
            core(q, k, v, dropout_p=0.0).sum().backward()
            wall += time.perf_counter() - start
            kernel.append(ring_times["compute_cpu_s"])
    all_to_all = sum(timers.pop()[0].values())
    return (wall / iters, (all_to_all + ring_times["exposed_wait_s"]) / iters, min(kernel[warmup:]))


def _plan(rank: int, ring_size: int, length: int, balanced: bool) -> ring_attention.RingPlan:
    """The module's own plan for a ring rank; for the contiguous split that it is compared
    against, rank r holds chunks 2r and 2r+1 (one contiguous N/R slice)."""
    chunks = tuple(
        ring_chunks(r, ring_size) if balanced else (2 * r, 2 * r + 1) for r in range(ring_size)
    )
    return ring_attention.RingPlan(rank, chunks, length // 2, None, None)


def rank_step_seconds(
    plan: ring_attention.RingPlan,
    ring_size: int,
    heads: int,
    head_dim: int,
    length: int,
    shift: int = 0,
) -> list[float]:
    """CPU seconds of each step of one rank's ring compute (R forward steps, then R backward
    steps), run alone on one thread: the module's own step functions (unit kernels, merges,
    gradient accumulation), with no communication. `shift` floats are allocated first, so
    that repeats place the tensors at different addresses: the allocator would otherwise
    give a rank's call the same memory every time, and a cache-unfriendly placement would
    follow one rank through all repeats."""
    padding = torch.empty(shift)  # noqa: F841 (held until the measurement ends)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(length, 1, heads, head_dim, generator=g) for _ in range(4))
    scale, srcs = head_dim**-0.5, [(plan.rank - s) % ring_size for s in range(ring_size)]
    kv = ring_attention.packed_kv(k, v)
    out = torch.zeros_like(q)
    lse = torch.full((1, heads, length), float("-inf"))
    dq, dkv = torch.zeros_like(q), torch.zeros(kv.shape)
    seconds = []
    for src in srcs:
        start = time.thread_time()
        ring_attention.forward_step(q, out, lse, kv, src, scale, plan)
        seconds.append(time.thread_time() - start)
    for src in srcs:
        start = time.thread_time()
        ring_attention.backward_step(q, dout, out, lse, kv, dq, dkv, src, scale, plan)
        seconds.append(time.thread_time() - start)
    return seconds


# ---- peak memory of the attention call ----------------------------------------------------
def _peak_bytes(fn) -> int:
    """Largest sum of live bytes that fn allocates on the CPU (torch's profiler: every
    allocation and free, in order), above what was live when it started."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def attention_peaks(rank, world, locals_, heads, head_dim, u, r) -> list[int]:
    """Peak bytes of one attention forward + backward on this rank (inputs excluded), per
    local sequence length in `locals_` (one process group for all: spawning is slow)."""
    dims = ps.initialize_model_parallel(1, u, 1, context_parallel_size=r)
    model_parallel_seed(1, dims, "cpu")
    core = DistributedAttention(u, LayerAttention(ring=Ring.from_dims(dims)), dims.sp_group)
    peaks = []
    for local in locals_:
        peaks.append(_call_peak(core, rank, local, heads, head_dim))
        if rank == 0:
            print(f"U{u}xR{r} L={local}: {peaks[-1] / MIB:.1f} MiB", flush=True)
    return peaks


def _call_peak(core, rank: int, local: int, heads: int, head_dim: int) -> int:
    g = torch.Generator().manual_seed(rank)
    q, k, v = (
        torch.randn(local, 1, heads, head_dim, generator=g).requires_grad_() for _ in range(3)
    )
    dout = torch.randn(local, 1, heads, head_dim, generator=g)
    dist.barrier()
    return _peak_bytes(lambda: core(q, k, v, dropout_p=0.0).backward(dout))


def memory_rows(chunks: list[int], heads: int, head_dim: int) -> list[tuple[int, int, int]]:
    """(C, ring peak bytes, Ulysses peak bytes at the same local tokens), max over ranks."""
    locals_ = [2 * c for c in chunks]
    ring = [max(p) for p in zip(*run_ranks(attention_peaks, 2, locals_, heads, head_dim, 1, 2))]
    ulysses = [max(p) for p in zip(*run_ranks(attention_peaks, 2, locals_, heads, head_dim, 2, 1))]
    return list(zip(chunks, ring, ulysses))


def table_memory(chunks: list[int], heads: int, head_dim: int) -> str:
    rows, previous = [], None
    for c, ring, ulysses in memory_rows(chunks, heads, head_dim):
        rows.append(
            [
                c,
                2 * c,
                4 * c,
                f"{ring / MIB:.1f}",
                f"{ring / previous:.2f}" if previous else "-",
                f"{ulysses / MIB:.1f}",
                f"{ring / ulysses:.2f}",
            ]
        )
        previous = ring
    return markdown_table(
        [
            "C",
            "local tokens L = 2C",
            "N",
            "ring R2 MiB",
            "× per doubling",
            "Ulysses U2 MiB (same L)",
            "ring / Ulysses",
        ],
        rows,
    )


def table_balance(seq: int, heads: int, head_dim: int, sizes: list[int], repeats: int) -> str:
    torch.set_num_threads(1)
    rows = []
    for r in sizes:
        length = seq // r
        for balanced in (True, False):
            plans = [_plan(c, r, length, balanced) for c in range(r)]
            # Ranks take turns within each repeat (starting one further each time), so a
            # burst of load elsewhere on the machine hits them alike.
            passes = [float("inf")] * r  # fastest whole pass
            steps = [[float("inf")] * (2 * r) for _ in range(r)]  # fastest run of each step
            shifts = random.Random(r)
            for repeat in range(repeats):
                for c in ((repeat + i) % r for i in range(r)):
                    run = rank_step_seconds(
                        plans[c], r, heads, head_dim, length, shifts.randrange(0, 2**16, 16)
                    )
                    passes[c] = min(passes[c], sum(run))
                    steps[c] = [min(a, b) for a, b in zip(steps[c], run)]
            per_step = [sum(s) for s in steps]
            rows.append(
                [
                    r,
                    "chunks r, 2R-1-r" if balanced else "contiguous (unbalanced)",
                    " / ".join(f"{1e3 * w:.1f}" for w in per_step),
                    f"{max(per_step) / min(per_step):.3f}",
                    " / ".join(f"{1e3 * w:.1f}" for w in passes),
                    f"{max(passes) / min(passes):.3f}",
                ]
            )
    return markdown_table(
        [
            "R",
            "layout",
            "ms per ring rank: sum of fastest steps",
            "max/min",
            "ms per ring rank: fastest whole pass",
            "max/min",
        ],
        rows,
    )


def table_time(seq: int, heads: int, head_dim: int, p: int, warmup: int, iters: int) -> str:
    rows = []
    for u, r in _layouts(p):
        if heads % u:
            continue
        per_rank = run_ranks(attention_time, p, seq, heads, head_dim, u, r, warmup, iters)
        wall = max(w for w, _, _ in per_rank)
        exposed = max(c for _, c, _ in per_rank)
        kernel = [k for _, _, k in per_rank]
        balance = f"{max(kernel) / min(kernel):.3f}" if r > 1 else "-"
        rows.append(
            [
                f"{_name(u, r)} U{u}×R{r}",
                f"{wall:.3f}",
                f"{wall - exposed:.3f}",
                f"{exposed:.3f}",
                f"{exposed / wall:.0%}",
                balance,
                " / ".join(f"{x:.3f}" for x in kernel) if r > 1 else "-",
            ]
        )
    return markdown_table(
        [
            "layout",
            "wall s",
            "compute s (wall - exposed)",
            "exposed comm s",
            "exposed share",
            "ring kernel max/min",
            "ring kernel CPU s per rank",
        ],
        rows,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq-length", type=int, default=4096)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--time-seq-length", type=int, default=2048)
    ap.add_argument("--time-size", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument(
        "--sections",
        nargs="+",
        choices=["bytes", "time", "balance", "memory"],
        default=["bytes", "time", "balance", "memory"],
    )
    ap.add_argument("--memory-chunks", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--memory-heads", type=int, default=2)
    ap.add_argument("--balance-sizes", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    n, h, heads = args.seq_length, args.hidden_size, args.heads
    if "bytes" in args.sections:
        _report_bytes(args, n, h, heads)
    if "time" in args.sections:
        _report_time(args, h, heads)
    if "memory" in args.sections:
        _report_memory(args, args.memory_heads, h // heads)
    if "balance" in args.sections:
        s = args.time_seq_length
        report(
            "ring-balance",
            "Causal load balance of the ring (CPU)",
            f"Attention compute each ring rank does in one forward + backward (N = {s}, "
            f"{heads} heads of {h // heads}, fp32, one thread), against a contiguous split "
            f"of the sequence. Each rank's work is run alone and the ranks one after "
            f"another, in one process, through `model/attention/ring.py`'s own plan and "
            f"step functions (unit kernels, merges, gradient accumulation; no "
            f"communication), so that ranks do not compete for the cores as concurrent "
            f"gloo ranks do. {args.repeats} rounds, the ranks taking turns in each; per "
            f"rank, the sum over its 2R steps of each step's fastest run, and its fastest "
            f"whole pass; each run places its tensors at a different address (a random "
            f"padding allocation first), so that no rank keeps one memory placement "
            f"through all rounds.",
            table_balance(s, heads, h // heads, args.balance_sizes, args.repeats),
            "Each ring step is cut into chunk × chunk units, so every rank runs the same "
            "sequence of kernel shapes (own step: causal, full, causal; every other step: "
            "two full units) on the same amount of data: the work is identical by "
            "construction and what remains is the machine's noise, smaller for the "
            "per-step minima (short runs are less often disturbed). A contiguous split "
            "makes the last rank do about 2R-1 times the first's work.",
            write_docs=args.write_docs,
        )


def _report_memory(args, heads, head_dim):
    report(
        "ring-memory",
        "Peak memory of ring attention per doubling (CPU)",
        f"One attention call (forward + backward) per rank, fp32, {heads} heads of "
        f"{head_dim}, micro-batch 1, 2 gloo ranks: the ring (U1×R2, chunks of C tokens, "
        f"local sequence L = 2C) against Ulysses alone (U2×R1) at the same L tokens per "
        f"rank (N = 2L). Peak = the largest sum of bytes allocated and not yet freed during "
        f"the call, every CPU allocation and free in order (torch's profiler), above the "
        f"inputs; max over ranks.",
        table_memory(args.memory_chunks, heads, head_dim),
        "Each unit runs a fused kernel that returns the log-sum-exp (torch's CPU flash "
        "kernel here): no C×C score tensor is held, and the ring keeps q, k, v, the fp32 "
        "partial output and log-sum-exp, the travelling k/v block and, backward, the fp32 "
        "dq and dk/dv accumulators, all linear in C.",
        write_docs=args.write_docs,
    )


def _report_bytes(args, n, h, heads):
    report(
        "ring-comm-volume",
        "Communication per layer: Ulysses, ring and hybrid",
        f"Bytes sent per rank in one transformer layer (fp32, N = {n}, h = {h}, {heads} "
        f"heads, micro-batch 1), counted by `mpu/comm_stats.py`, next to the formulas of "
        f"`tools/bench/bench_ring.py` (U·R = P; the all-to-all runs on the N/R tokens of a "
        f"ring rank, the ring on h/U of the heads).",
        table_bytes(n, h, heads, args.sizes),
        "Ulysses moves the fewest bytes (4Nh(P-1)/P² forward) but its degree stops at the "
        "head count; the ring moves 2Nh(R-1)/R (P/2 times more at large P) but only "
        "between neighbours, overlapped with the block compute; a hybrid divides the "
        "ring's bytes by U.",
        write_docs=args.write_docs,
    )


def _report_time(args, h, heads):
    s, p = args.time_seq_length, args.time_size
    report(
        "ring-time",
        "Attention time split: Ulysses, ring and hybrid (CPU)",
        f"Attention core forward + backward per iteration (fp32, N = {s}, {heads} heads of "
        f"{h // heads}, micro-batch 1, P = {p} gloo ranks, mean of {args.iters} after "
        f"{args.warmup} warm-up); max over ranks. Exposed communication = time inside "
        f"the all-to-all + time blocked waiting for a ring block that had not arrived. "
        f"Ring kernel CPU s per rank: thread CPU time in the unit kernels, each rank's "
        f"fastest iteration.",
        table_time(s, heads, h // heads, p, args.warmup, args.iters),
        "On CPU the local kernels differ (Ulysses calls SDPA's fused kernel, the ring its "
        "explicit fp32 unit kernel), so compare exposed communication rather than compute "
        "across rows. The ring kernel max/min here comes from P concurrent processes on "
        "the machine's cores and measures the scheduler as much as the work; the "
        "balance section below measures each rank's work alone.",
        write_docs=args.write_docs,
    )


if __name__ == "__main__":
    main()
