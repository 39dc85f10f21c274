#!/usr/bin/env python
"""Our Ulysses layer (model/ulysses.py) side by side with DeepSpeed's DistributedAttention.

Both wrap the same local attention (model/attention.py's SDPA call) around their all-to-alls,
on the same gloo ranks, the same inputs [N/SP, b, heads, d] (sequence first) and upstream
gradient: outputs and input gradients are compared bit for bit, the attention layer's forward
+ backward is timed (rounds alternate the two, the fastest round of each is kept: noise on a
shared machine only adds), and the bytes each rank sends through all_to_all_single are counted
(both end there).

DeepSpeed is an optional, benchmark-only dependency (DS_BUILD_OPS=0, a venv of its own):

    python -m venv --system-site-packages /work/venvs/ds
    DS_BUILD_OPS=0 /work/venvs/ds/bin/pip install --no-deps deepspeed psutil hjson py-cpuinfo \\
        msgpack ninja einops
    /work/venvs/ds/bin/python -m tools.bench.bench_vs_deepspeed [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from tools.bench.common import markdown_table, report, run_ranks

from megatron_ul.model.attention import local_attention
from megatron_ul.model.ulysses import DistributedAttention
from megatron_ul.mpu import parallel_state as ps
from megatron_ul.mpu.random import model_parallel_seed

MB = 1e6
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@contextmanager
def counted_all_to_all(group_size: int, rank: int):
    """{'bytes': ...}: bytes this rank sends to other ranks through all_to_all_single."""
    sent = {"bytes": 0}
    real = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        row = input[0].numel() * input.element_size() if input.dim() else input.element_size()
        splits = input_split_sizes or [input.shape[0] // group_size] * group_size
        sent["bytes"] += sum(s for j, s in enumerate(splits) if j != rank) * row
        return real(output, input, output_split_sizes, input_split_sizes, **kwargs)

    # patched on purpose: counts the bytes, then sends them
    dist.all_to_all_single = counting  # type: ignore[assignment]
    try:
        yield sent
    finally:
        dist.all_to_all_single = real


def _deepspeed_layer(dims, kv_heads: int):
    os.environ.setdefault("DS_BUILD_OPS", "0")
    import deepspeed
    import deepspeed.comm
    from deepspeed.sequence.layer import DistributedAttention as DeepSpeedAttention
    from deepspeed.utils import groups

    class _SequenceGroup:  # what DeepSpeed's uneven-head path asks for the SP rank
        def get_sequence_parallel_rank(self):
            return dims.sp_rank

        def get_sequence_parallel_group(self):
            return dims.sp_group

        def get_sequence_parallel_world_size(self):
            return dims.sp

    if not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(
            dist_backend="gloo", auto_mpi_discovery=False, verbose=False
        )
    groups.mpu = _SequenceGroup()
    attend = lambda q, k, v: local_attention(q, k, v, backend="sdpa", dropout_p=0.0)  # noqa: E731
    return DeepSpeedAttention(
        attend, dims.sp_group, scatter_idx=2, gather_idx=0, num_kv_heads=kv_heads
    )


def compare(dims, rank, world, seq, heads, kv_heads, head_dim, dtype_name, rounds):
    """(bit-equal output, bit-equal grads, our s, DeepSpeed s, our MB sent, DeepSpeed MB)."""
    ours = DistributedAttention(world, "sdpa", dims.sp_group)
    theirs = _deepspeed_layer(dims, kv_heads)
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(rank)
    shapes = [heads, kv_heads, kv_heads]
    inputs = [torch.randn(seq // world, 1, h, head_dim, generator=g).to(dtype) for h in shapes]
    dout = torch.randn(seq // world, 1, heads, head_dim, generator=g).to(dtype)

    def run(layer, call):
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        dist.barrier()
        start = time.perf_counter()
        out = call(layer, q, k, v)
        out.backward(dout)
        return time.perf_counter() - start, out.detach(), [t.grad for t in (q, k, v)]

    ours_call = lambda layer, q, k, v: layer(q, k, v, dropout_p=0.0)  # noqa: E731
    theirs_call = lambda layer, q, k, v: layer(q, k, v, 1)  # noqa: E731   (batch dim 1)
    with counted_all_to_all(world, dims.sp_rank) as sent:
        _, out_a, grads_a = run(ours, ours_call)
    ours_bytes = sent["bytes"]
    with counted_all_to_all(world, dims.sp_rank) as sent:
        _, out_b, grads_b = run(theirs, theirs_call)
    theirs_bytes = sent["bytes"]
    same_out = torch.equal(out_a, out_b)
    same_grads = all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    best_ours = best_theirs = float("inf")
    for _ in range(rounds):
        best_ours = min(best_ours, run(ours, ours_call)[0])
        best_theirs = min(best_theirs, run(theirs, theirs_call)[0])
    return (same_out, same_grads, best_ours, best_theirs, ours_bytes / MB, theirs_bytes / MB)


def compare_all(rank, world, cases, rounds):
    """compare() for every (N, q heads, kv heads, dtype) case, in one process group."""
    torch.set_num_threads(1)
    dims = ps.initialize_model_parallel(1, world, 1)
    model_parallel_seed(1, dims, "cpu")
    results = []
    for seq, heads, kv_heads, dtype in cases:
        results.append(compare(dims, rank, world, seq, heads, kv_heads, 64, dtype, rounds))
        if rank == 0:  # progress: a long matrix on a shared machine
            print(f"SP{world} N={seq} {heads}/{kv_heads} {dtype}: {results[-1]}", flush=True)
    return results


def table(cases, rounds: int) -> str:
    results = {}
    for sp in sorted({case[1] for case in cases}):  # one spawn per SP: DeepSpeed imports slowly
        mine = [(n, h, kv, dt) for n, s, h, kv, dt in cases if s == sp]
        for case, per_rank in zip(mine, zip(*run_ranks(compare_all, sp, mine, rounds))):
            key = (case[0], sp, *case[1:])
            results[key] = per_rank
    rows = []
    for seq, sp, heads, kv_heads, dtype in cases:
        per_rank = results[(seq, sp, heads, kv_heads, dtype)]
        ours = max(r[2] for r in per_rank)
        theirs = max(r[3] for r in per_rank)
        rows.append(
            [
                seq,
                sp,
                f"{heads}/{kv_heads}",
                dtype,
                "yes" if all(r[0] for r in per_rank) else "NO",
                "yes" if all(r[1] for r in per_rank) else "NO",
                f"{ours * 1e3:.0f}",
                f"{theirs * 1e3:.0f}",
                f"{ours / theirs:.2f}",
                f"{max(r[4] for r in per_rank):.2f}",
                f"{max(r[5] for r in per_rank):.2f}",
            ]
        )
    return markdown_table(
        [
            "N",
            "SP",
            "q/kv heads",
            "dtype",
            "output bit-equal",
            "grads bit-equal",
            "ours ms",
            "DeepSpeed ms",
            "ours / DeepSpeed",
            "ours MB sent (max rank)",
            "DeepSpeed MB sent (max rank)",
        ],
        rows,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq-lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--heads", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gqa-seq-length", type=int, default=4096)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    cases = [
        (n, sp, h, h, args.dtype) for n in args.seq_lengths for sp in args.sizes for h in args.heads
    ]
    cases.append((args.gqa_seq_length, 4, 12, 6, args.dtype))
    report(
        "vs-deepspeed",
        "Ulysses layer vs DeepSpeed's DistributedAttention (CPU, gloo)",
        f"One attention layer (all-to-alls + the same SDPA local attention), forward + "
        f"backward, micro-batch 1, head dim 64, {args.dtype}, one thread per rank; both "
        f"layers get the same inputs and upstream gradient. Time: the fastest of "
        f"{args.rounds} alternating rounds, max over ranks. Bytes: what each rank sends "
        f"through all_to_all_single in forward + backward, max over ranks.",
        table(cases, args.rounds),
        write_docs=args.write_docs,
    )


if __name__ == "__main__":
    main()
