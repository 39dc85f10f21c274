#!/usr/bin/env python
"""Measures the pipeline bubble of the 1F1B and interleaved 1F1B schedules.

For each layout, spawns PP gloo ranks on this machine (one thread each), runs the real
schedule (megatron_ul.pipeline.schedules) on a model big enough that compute dominates the
point-to-point traffic, and times on every rank the wall time of one forward-backward over
the global batch and the time spent blocked waiting for a neighbour (each step's batched
send/receive, StageCommunicator.communicate). Bubble = blocked time / wall time, averaged over
ranks (min-max in brackets), printed next to the formulas (p-1)/(m+p-1) for 1F1B and
(p-1)/(v·m+p-1) for interleaved.

With --write-docs the table replaces the benchmark section of docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

from tools.bench.common import run_ranks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DOCS_PATH = os.path.join(REPO_ROOT, "docs", "pipeline.md")
BENCH_START, BENCH_END = "<!-- bench:start -->", "<!-- bench:end -->"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--iters", type=int, default=3, help="timed iterations (after 1 warm-up)")
    parser.add_argument("--write-docs", action="store_true")
    return parser.parse_args(argv)


def layouts(num_layers: int):
    """(name, PP, layers per virtual stage or None)"""
    return [
        ("1F1B PP=2", 2, None),
        ("1F1B PP=4", 4, None),
        ("interleaved PP=2 v=2", 2, num_layers // 4),
        ("interleaved PP=4 v=2", 4, num_layers // 8),
    ]


def trainer_flags(args, pp: int, per_virtual) -> list[str]:
    flags = [
        "--mock-data",
        "--vocab-size",
        "1000",
        "--num-layers",
        str(args.num_layers),
        "--hidden-size",
        str(args.hidden_size),
        "--num-attention-heads",
        "8",
        "--seq-length",
        str(args.seq_length),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        str(args.micro_batches),
        "--train-iters",
        "100",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--pipeline-model-parallel-size",
        str(pp),
    ]
    if per_virtual:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(per_virtual)]
    return flags


def _instrument_waits(counter: dict) -> None:
    """Count the time each rank spends blocked on its neighbours."""
    from megatron_ul.pipeline.p2p import StageCommunicator

    communicate = StageCommunicator.communicate

    def timed(fn):
        def run(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                counter["blocked"] += time.perf_counter() - start

        return run

    # patched on purpose: the benchmark times every call
    StageCommunicator.communicate = timed(communicate)  # type: ignore[method-assign]


def _measure_rank(rank, world, flags, iters):
    """(wall seconds, seconds blocked on neighbours) over `iters` forward-backward passes."""
    import torch.distributed as dist

    from megatron_ul.initialize import initialize_distributed, shutdown
    from megatron_ul.training.data import build_datasets, global_batches
    from megatron_ul.training.pretrain import build_model, configure
    from megatron_ul.training.step import count_tokens, schedule_for

    try:
        cfg = configure(flags, world)
        device, dims = initialize_distributed(cfg)
        model = build_model(cfg, device, dims)
        batches = global_batches(cfg, dims, build_datasets(cfg)[0], device, None)
        counter = {"blocked": 0.0}
        _instrument_waits(counter)
        walls, blocked = [], []
        for it in range(iters + 1):
            micro_batches = next(batches)
            num_tokens = count_tokens(micro_batches, device, dims).float()
            dist.barrier()
            counter["blocked"], start = 0.0, time.perf_counter()
            schedule_for(model)(model, micro_batches, num_tokens)
            if it > 0:  # the first iteration warms up allocators and gloo connections
                walls.append(time.perf_counter() - start)
                blocked.append(counter["blocked"])
            model.zero_grad(set_to_none=True)
        return sum(walls), sum(blocked)
    finally:
        shutdown()


def measure(flags: list[str], world: int, iters: int) -> list[tuple[float, float]]:
    return run_ranks(_measure_rank, world, flags, iters)


def table(args) -> str:
    m = args.micro_batches
    lines = [
        "| schedule | p | v | m | formula | measured bubble (mean over stages) | "
        "per-stage range | ms per forward-backward |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, pp, per_virtual in layouts(args.num_layers):
        v = args.num_layers // (pp * per_virtual) if per_virtual else 1
        per_rank = measure(trainer_flags(args, pp, per_virtual), pp, args.iters)
        fractions = [b / w for w, b in per_rank]
        formula = (pp - 1) / (v * m + pp - 1)
        wall_ms = max(w for w, _ in per_rank) / args.iters * 1e3
        lines.append(
            f"| {name} | {pp} | {v} | {m} | {formula:.3f} | "
            f"{sum(fractions) / len(fractions):.3f} | {min(fractions):.3f}–"
            f"{max(fractions):.3f} | {wall_ms:.0f} |"
        )
        print(lines[-1], flush=True)
    return "\n".join(lines)


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"torch {torch.__version__}, gloo, one thread per rank, load average "
        f"{os.getloadavg()[0]:.1f} at the end of the run"
    )


def main(argv=None):
    args = parse_args(argv)
    result = table(args)
    command = "python -m tools.bench.bench_pipeline_bubble " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:])
    )
    section = (
        f"{BENCH_START}\nCommand: `{command.strip()}`\n\nModel: {args.num_layers} layers, "
        f"hidden {args.hidden_size}, 8 heads, sequence {args.seq_length}, micro-batch 1, "
        f"{args.micro_batches} micro-batches, fp32.\nMachine: {machine()}.\n\n{result}\n"
        f"{BENCH_END}"
    )
    print("\n" + section)
    if args.write_docs:
        text = open(DOCS_PATH).read()
        head, rest = text.split(BENCH_START)
        tail = rest.split(BENCH_END)[1]
        with open(DOCS_PATH, "w") as f:
            f.write(head + section + tail)


if __name__ == "__main__":
    main()
