#!/usr/bin/env python
"""Exposed gradient-reduction time with and without --overlap-grad-reduce, measured with the
training timers ("grad-reduce": the time train_step waits for the gradient reduction after
backward) on CPU gloo ranks, at DP2 and SP2×DP2, plain data parallelism and ZeRO-1.

    flock /tmp/heavy.lock python -m tools.bench.bench_overlap [--iters 4] [--write-docs]
"""

import argparse

from tools.bench.common import markdown_table, report, run_ranks, timed_training

MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "512",
    "--num-attention-heads",
    "8",
    "--vocab-size",
    "8000",
    "--seq-length",
    "256",
    "--micro-batch-size",
    "1",
    "--mock-data",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--train-iters",
    "100",
    "--log-interval",
    "1000",
    "--distributed-timeout-minutes",
    "10",
]
LAYOUTS = {  # name -> (flags, world)
    "DP2": ([], 2),
    "SP2×DP2": (["--ds-sequence-parallel-size", "2"], 4),
}
OPTIMIZERS = {"plain DP": [], "ZeRO-1": ["--use-distributed-optimizer"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument(
        "--bucket-size", type=int, default=1_000_000, help="--ddp-bucket-size (elements)"
    )
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    rows = []
    for layout, (flags, world) in LAYOUTS.items():
        for optimizer, optimizer_flags in OPTIMIZERS.items():
            measured = {}
            for overlap in (False, True):
                argv = (
                    MODEL
                    + flags
                    + optimizer_flags
                    + ["--ddp-bucket-size", str(args.bucket_size)]
                    + ["--global-batch-size", str(2 * world // (2 if flags else 1))]
                    + (["--overlap-grad-reduce"] if overlap else [])
                )
                per_rank = run_ranks(timed_training, world, argv, 1, args.iters, True)
                # The slowest rank decides the step; average the exposed reduction over ranks.
                step = max(r[0] for r in per_rank)
                reduce = sum(r[1].get("grad-reduce", 0.0) for r in per_rank) / len(per_rank)
                backward = sum(r[1].get("backward", 0.0) for r in per_rank) / len(per_rank)
                measured[overlap] = (step, reduce, backward)
                print(layout, optimizer, overlap, measured[overlap], flush=True)
            (s0, r0, b0), (s1, r1, b1) = measured[False], measured[True]
            rows.append(
                [
                    layout,
                    optimizer,
                    f"{r0 * 1e3:.0f}",
                    f"{r1 * 1e3:.0f}",
                    f"{r1 / r0:.2f}",
                    f"{b0 * 1e3:.0f}",
                    f"{b1 * 1e3:.0f}",
                    f"{s0:.3f}",
                    f"{s1:.3f}",
                    f"{s1 / s0:.2f}",
                ]
            )
    table = markdown_table(
        [
            "layout",
            "optimizer",
            "exposed grad-reduce ms (after backward)",
            "exposed grad-reduce ms (overlapped)",
            "overlapped / after",
            "backward ms (after)",
            "backward ms (overlapped)",
            "step s (after)",
            "step s (overlapped)",
            "step ratio",
        ],
        rows,
    )
    report(
        "overlap",
        "Gradient reduction overlapped with backward (--overlap-grad-reduce)",
        f"GPT-2-style model, 4 layers, hidden 512, vocab 8000, seq 256, 2 micro-batches of 1 "
        f"sequence per rank and step (the reduction follows the last one); "
        f'--ddp-bucket-size {args.bucket_size}; fp32. "Exposed grad-reduce" is the '
        f"training timer around the wait for the gradient reduction after backward "
        f"(--timing-log-level 1), averaged over ranks; {args.iters} iterations after one "
        f"warm-up.",
        table,
        conclusion(rows),
        write_docs=args.write_docs,
    )


def conclusion(rows) -> str:
    exposed = ", ".join(f"{r[0]} {r[1]} {r[4]}×" for r in rows)
    step = ", ".join(f"{r[0]} {r[1]} {r[9]}×" for r in rows)
    return (
        f"Overlapped / after backward, exposed reduction: {exposed}; step time: {step}. "
        "Most buckets are reduced while backward runs; whether the step gains depends on "
        "spare cores: here gloo's reduction competes with backward for 2 shared CPU cores "
        "(see the backward columns)."
    )


if __name__ == "__main__":
    main()
