#!/usr/bin/env python
"""--fused-layers (torch.compile per transformer layer) against eager layers, GPT-2 and Llama
styles, on CPU: bytes autograd keeps for backward per layer (tools/bench/saved_bytes.py) and
training step time (one process, after warm-up iterations that include the compilation).

    flock /tmp/heavy.lock python -m tools.bench.bench_fused [--iters 3] [--write-docs]
"""

import argparse
import time

from tools.bench.common import markdown_table, report, run_ranks, timed_training
from tools.bench.saved_bytes import measure

MiB = 2**20
SHAPE = [
    "--num-layers",
    "2",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--vocab-size",
    "2000",
    "--seq-length",
    "512",
    "--micro-batch-size",
    "1",
    "--mock-data",
    "--attention-dropout",
    "0.1",
    "--hidden-dropout",
    "0.1",
    "--train-iters",
    "100",
    "--log-interval",
    "1000",
]
STYLES = {
    "GPT-2": [],
    "Llama": [
        "--position-embedding-type",
        "rope",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
    ],
}
FUSED = ["--fused-layers"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    rows = []
    for style, flags in STYLES.items():
        saved, step, compile_s = {}, {}, {}
        for fused in (False, True):
            argv = SHAPE + flags + (FUSED if fused else [])
            probe = run_ranks(measure, 1, argv)[0]
            saved[fused] = probe["saved"]["layer0"]
            start = time.perf_counter()
            step[fused], _ = run_ranks(timed_training, 1, argv, args.warmup, args.iters, False)[0]
            compile_s[fused] = time.perf_counter() - start - step[fused] * args.iters
            print(style, fused, saved[fused], step[fused], flush=True)
        rows.append(
            [
                style,
                f"{saved[False] / MiB:.2f}",
                f"{saved[True] / MiB:.2f}",
                f"{saved[True] / saved[False]:.2f}",
                f"{step[False]:.3f}",
                f"{step[True]:.3f}",
                f"{step[True] / step[False]:.2f}",
                f"{compile_s[True] - compile_s[False]:.0f}",
            ]
        )
    table = markdown_table(
        [
            "style",
            "kept for backward per layer MiB (eager)",
            "(fused)",
            "fused / eager",
            "step s (eager)",
            "step s (fused)",
            "fused / eager",
            "extra start-up s (compilation)",
        ],
        rows,
    )
    report(
        "fused",
        "Fused transformer layers (--fused-layers) vs eager",
        "2 layers, hidden 256, 4 heads, seq 512, micro-batch 1, dropout 0.1, fp32, one "
        f"process. Kept bytes: layer 0's saved tensors in one forward "
        f"(tools/bench/saved_bytes.py). Step time: mean of {args.iters} steps after "
        f"{args.warmup} warm-up steps (the compilation happens in the first).",
        table,
        conclusion(rows),
        write_docs=args.write_docs,
    )


def conclusion(rows) -> str:
    memory = ", ".join(f"{r[0]} {r[3]}×" for r in rows)
    speed = ", ".join(f"{r[0]} {r[6]}×" for r in rows)
    return (
        f"Fused / eager, kept bytes per layer: {memory}; step time: {speed}. "
        "--fused-layers stays off by default (compilation costs start-up time on every "
        "run); the start-up log says whether layers run eager or fused."
    )


if __name__ == "__main__":
    main()
