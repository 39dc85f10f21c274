"""Shard-only initialisation: per-rank build time and peak memory of a >= 1B-parameter model
at TP1, TP2, PP2 and ZeRO-3 over 2 ranks (CPU gloo ranks, one thread each).

    flock /tmp/heavy.lock bash -c 'ulimit -v 12000000; python -m tools.bench.bench_init \
        --write-docs'

"Build" is what pretrain.setup does before the optimizer: building the model (on the meta
device and materialising the ZeRO-3 shards under --zero-stage 3). The ranks of a layout build
one after another (nothing in the build communicates), each with the machine to itself. Peak
memory is the rise of the process's peak RSS over its RSS just before the build; CPU time is
the process's own (robust to other load on the machine), wall time is also given.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from tools.bench.common import markdown_table, report, run_ranks

# Megatron's GPT-2 1.3B shape (24 layers, hidden 2048, 16 heads, GPT-2 vocabulary).
MODEL_1_3B = [
    "--num-layers",
    "24",
    "--hidden-size",
    "2048",
    "--num-attention-heads",
    "16",
    "--seq-length",
    "2048",
    "--vocab-size",
    "50257",
]
COMMON = [
    "--mock-data",
    "--micro-batch-size",
    "1",
    "--train-iters",
    "1",
    "--distributed-timeout-minutes",
    "30",
]
LAYOUTS = {  # name -> (flags, world, shards per rank)
    "TP1": ([], 1, 1),
    "TP2": (["--tensor-model-parallel-size", "2"], 2, 2),
    "PP2": (["--pipeline-model-parallel-size", "2"], 2, 2),
    "ZeRO-3 DP2": (["--zero-stage", "3"], 2, 2),
}
GiB = 2**30


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_on_rank(rank, world, argv):
    import torch
    from torch.distributed.tensor import DTensor

    from megatron_ul.initialize import initialize_distributed
    from megatron_ul.training.pretrain import build_model, configure

    cfg = configure(argv, world)
    device, dims = initialize_distributed(cfg)
    # The ranks build one after another, so that each has the machine's cores to itself (as
    # each GPU's host share would) and the CPU times compare across layouts.
    for turn in range(world):
        torch.distributed.barrier()
        if turn != rank:
            continue
        before = _rss_bytes()
        wall, cpu = time.perf_counter(), time.process_time()
        model = build_model(cfg, device, dims)  # pretrain.setup's build, ZeRO-3 included
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    held = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in model.parameters()
    )
    total = sum(p.numel() for p in model.parameters())  # this rank's (TP/PP) model part
    torch.distributed.barrier()
    return {"wall": wall, "cpu": cpu, "peak": peak, "held": held, "params": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    args = parser.parse_args()
    rows, base = [], None
    for name in args.layouts:
        flags, world, shards = LAYOUTS[name]
        per_rank = run_ranks(build_on_rank, world, COMMON + MODEL_1_3B + flags)
        worst = {k: max(r[k] for r in per_rank) for k in ("wall", "cpu", "peak", "held")}
        if base is None:
            base = worst
            full_params = per_rank[0]["params"]
        ratio = {k: worst[k] / base[k] for k in ("cpu", "peak")}
        rows.append(
            [
                name,
                world,
                f"{worst['held'] / GiB:.2f}",
                f"{worst['peak'] / GiB:.2f}",
                f"{worst['cpu']:.1f}",
                f"{worst['wall']:.1f}",
                f"{ratio['cpu']:.2f}",
                f"{ratio['peak']:.2f}",
                f"{1 / shards:.2f}",
            ]
        )
        print(rows[-1], flush=True)
    table = markdown_table(
        [
            "layout",
            "ranks",
            "params held GiB (max rank)",
            "peak RSS rise GiB (max rank)",
            "build CPU s (max rank)",
            "build wall s (max rank)",
            "CPU vs TP1",
            "peak vs TP1",
            "ideal 1/shards",
        ],
        rows,
    )
    report(
        "init",
        "Shard-only initialisation of the 1.3B model",
        f"GPT-2 1.3B shape ({full_params / 1e9:.2f} B parameters, fp32), built per rank as "
        "pretrain.setup does: every rank computes only the elements it holds (its TP slice, "
        "its pipeline stage, its ZeRO-3 shard) with the counter-based generator of "
        "mpu/param_init.py. Gloo ranks, one thread each, building one after another.",
        table,
        "Each rank's build CPU time and peak memory scale as 1/(TP·PP·ZeRO-3 shards); the "
        "PP2 stages both hold the tied embedding (first stage: table, last stage: its copy), "
        "so their share is (L/2 layers + embedding) / (L layers + embedding).",
        write_docs=args.write_docs,
    )


if __name__ == "__main__":
    main()
