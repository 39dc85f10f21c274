#!/usr/bin/env python
"""Ulysses (U = P), ring (R = P) and hybrid (U × R = P) sequence parallelism side by side.

1. Bytes one rank sends in one transformer layer, forward and backward (mpu/comm_stats.py),
   next to the formulas, in units of N·h elements (MHA, kv heads = heads):
     Ulysses all-to-all on the N/R tokens of a ring rank: 4·(N/R)·h/U · (U-1)/U
     ring, forward: each k/v block (2·(N/R)·h/U) travels R-1 hops:          2·N·h·(R-1)/(R·U)
     ring, backward: k/v again R-1 hops, plus dk/dv (fp32) R hops:          2·N·h·(2R-1)/(R·U)
2. Time split of the attention core (forward + backward) per rank on CPU: wall time, attention
   compute, exposed communication (all-to-all time + time blocked waiting for ring blocks), and
   the ring's causal load balance: max/min over ranks of the block-kernel CPU time.

    python -m tools.bench.bench_ring [--seq-length 4096 --hidden-size 512] [--write-docs]
"""
import argparse
import time

import torch
import torch.distributed as dist

from tools.bench.bench_comm_volume import layer_bytes
from tools.bench.common import markdown_table, report, run_ranks

from megatron_ul.model import ring_attention
from megatron_ul.model.ring_attention import Ring, measure_ring_time
from megatron_ul.model.ulysses import DistributedAttention
from megatron_ul.mpu import parallel_state as ps
from megatron_ul.mpu.random import model_parallel_seed
from megatron_ul.timers import Timers

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
            rows.append([p, f"{_name(u, r)} U{u}×R{r}",
                         f"{fwd.get('all_to_all', 0) / MIB:.2f}", f"{fwd.get('p2p', 0) / MIB:.2f}",
                         f"{sum(fwd.values()) / MIB:.2f}", f"{f_nh * unit / MIB:.2f}",
                         f"{sum(bwd.values()) / MIB:.2f}", f"{b_nh * unit / MIB:.2f}",
                         f"{f_nh:.3f}·Nh"])
    return markdown_table(["P", "layout", "fwd all-to-all MiB", "fwd p2p MiB", "fwd MiB",
                           "fwd formula MiB", "bwd MiB", "bwd formula MiB", "fwd formula"],
                          rows)


def attention_time(rank, world, seq, heads, head_dim, u, r, warmup, iters):
    """Per iteration: (wall s, exposed comm s, ring kernel CPU s) of the attention core; the
    kernel time is the fastest iteration's (other jobs on a shared machine only add to it)."""
    dims = ps.initialize_model_parallel(1, u, 1, context_parallel_size=r)
    model_parallel_seed(1, dims, "cpu")
    timers = Timers(1)   # times the Ulysses all-to-alls
    core = DistributedAttention(u, "sdpa", dims.sp_group, timers=timers,
                                ring=Ring.from_dims(dims))
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(seq // world, 1, heads, head_dim, generator=g).requires_grad_()
               for _ in range(3))
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
    return (wall / iters, (all_to_all + ring_times["exposed_wait_s"]) / iters,
            min(kernel[warmup:]))


def _blocks_of(rank: int, ring_size: int, length: int, balanced: bool) -> list:
    """The (rows, cols, causal) blocks a ring rank computes over one ring pass: the module's own
    plan for the balanced layout; for a contiguous layout (rank r holds chunk r of R) its
    diagonal block and one full block per earlier rank."""
    if balanced:
        ring = Ring(None, rank, ring_size, 0, 0)
        return [ring_attention._causal_block(step, ring, length) for step in range(ring_size)]
    everything = slice(0, length)
    return ([ring_attention._Block(everything, everything, True)]
            + [ring_attention._Block(everything, everything, False)] * rank)


def rank_work_seconds(blocks: list, heads: int, head_dim: int, length: int) -> float:
    """One single-threaded run of these blocks' forward + backward kernels (CPU seconds)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, head_dim, generator=g) for _ in range(3))
    scale = head_dim ** -0.5
    start = time.thread_time()
    for b in blocks:
        rows = q[:, :, b.rows].contiguous()
        out, lse = ring_attention._block_forward(rows, k[:, :, b.cols], v[:, :, b.cols],
                                                 scale, b, None, 1)
        ring_attention._block_backward(rows, k[:, :, b.cols], v[:, :, b.cols], out, lse,
                                       (out * out).sum(-1), scale, b, None, 1)
    return time.thread_time() - start


def table_balance(seq: int, heads: int, head_dim: int, sizes: list[int], repeats: int) -> str:
    torch.set_num_threads(1)
    rows = []
    for r in sizes:
        length = seq // r
        for balanced in (True, False):
            # Ranks take turns within each repeat, so a burst of load elsewhere on the machine
            # hits them alike; each keeps its fastest run.
            work = [float("inf")] * r
            for _ in range(repeats):
                for c in range(r):
                    work[c] = min(work[c], rank_work_seconds(
                        _blocks_of(c, r, length, balanced), heads, head_dim, length))
            rows.append([r, "chunks r, 2R-1-r" if balanced else "contiguous (unbalanced)",
                         " / ".join(f"{1e3 * w:.0f}" for w in work),
                         f"{max(work) / min(work):.3f}"])
    return markdown_table(["R", "layout", "attention kernel ms per ring rank (fwd+bwd)",
                           "max/min"], rows)


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
        rows.append([f"{_name(u, r)} U{u}×R{r}", f"{wall:.3f}", f"{wall - exposed:.3f}",
                     f"{exposed:.3f}", f"{exposed / wall:.0%}", balance,
                     " / ".join(f"{x:.3f}" for x in kernel) if r > 1 else "-"])
    return markdown_table(["layout", "wall s", "compute s (wall - exposed)", "exposed comm s",
                           "exposed share", "ring kernel max/min", "ring kernel CPU s per rank"],
                          rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-length", type=int, default=4096)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--time-seq-length", type=int, default=2048)
    ap.add_argument("--time-size", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--sections", nargs="+", choices=["bytes", "time", "balance"],
                    default=["bytes", "time", "balance"])
    ap.add_argument("--balance-sizes", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    n, h, heads = args.seq_length, args.hidden_size, args.heads
    if "bytes" in args.sections:
        _report_bytes(args, n, h, heads)
    if "time" in args.sections:
        _report_time(args, h, heads)
    if "balance" in args.sections:
        s = args.time_seq_length
        report("ring-balance", "Causal load balance of the ring (CPU)",
               f"Attention work each ring rank does in one forward + backward (N = {s}, "
               f"{heads} heads of {h // heads}, fp32, one thread): the blocks of "
               f"`model/ring_attention.py`'s plan run through its own block kernels in one "
               f"process, each rank's fastest of {args.repeats} runs (so that other jobs on a "
               f"shared machine do not count), against a contiguous split of the sequence.",
               table_balance(s, heads, h // heads, args.balance_sizes, args.repeats),
               "With chunks r and 2R-1-r every rank does the same work (the own-block step "
               "computes the L×L block and masks half of it, on every rank alike); a "
               "contiguous split makes the last rank do about 2R-1 times the first's. The block "
               "flops are identical by construction; the measured spread is machine noise "
               "(four runs on this shared, oversubscribed 2-core machine gave max/min "
               "1.07-1.16 at R = 4 and 1.09-1.19 at R = 8). The multi-rank measurement above "
               "is noisier: on an oversubscribed machine per-rank "
               "CPU time also depends on who shares a core.", write_docs=args.write_docs)


def _report_bytes(args, n, h, heads):
    report("ring-comm-volume", "Communication per layer: Ulysses, ring and hybrid",
           f"Bytes sent per rank in one transformer layer (fp32, N = {n}, h = {h}, {heads} "
           f"heads, micro-batch 1), counted by `mpu/comm_stats.py`, next to the formulas of "
           f"`tools/bench/bench_ring.py` (U·R = P; the all-to-all runs on the N/R tokens of a "
           f"ring rank, the ring on h/U of the heads).",
           table_bytes(n, h, heads, args.sizes),
           "Ulysses moves the fewest bytes (4Nh(P-1)/P² forward) but its degree stops at the "
           "head count; the ring moves 2Nh(R-1)/R (P/2 times more at large P) but only "
           "between neighbours, overlapped with the block compute; a hybrid divides the "
           "ring's bytes by U.", write_docs=args.write_docs)


def _report_time(args, h, heads):
    s, p = args.time_seq_length, args.time_size
    report("ring-time", "Attention time split: Ulysses, ring and hybrid (CPU)",
           f"Attention core forward + backward per iteration (fp32, N = {s}, {heads} heads of "
           f"{h // heads}, micro-batch 1, P = {p} gloo ranks, mean of {args.iters} after "
           f"{args.warmup} warm-up); max over ranks. Exposed communication = time inside "
           f"the all-to-all + time blocked waiting for a ring block that had not arrived. "
           f"Ring kernel max/min: the causal load balance (block-kernel CPU time per rank, "
           f"chunks r and 2R-1-r; each rank's fastest iteration).",
           table_time(s, heads, h // heads, p, args.warmup, args.iters),
           "On CPU the local kernels differ (Ulysses calls SDPA's fused kernel, the ring its "
           "explicit fp32 block kernel), so compare exposed communication and balance rather "
           "than compute across rows.", write_docs=args.write_docs)


if __name__ == "__main__":
    main()
