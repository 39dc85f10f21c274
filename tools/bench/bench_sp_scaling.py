#!/usr/bin/env python
"""Ulysses scaling on CPU: SP=2 against SP=1 at N = 4096 and 8192, one thread per rank, same
model and global batch; tokens/s ratio (ideal 2×). SP=1 and SP=2 runs alternate in one
invocation and the fastest of each counts, so that load from other processes on a shared
machine does not decide the ratio.

    python -m tools.bench.bench_sp_scaling [--seq 4096 8192] [--write-docs]
"""

import argparse

from tools.bench.common import markdown_table, report, run_ranks, timed_training


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="alternating runs per SP degree; the fastest counts (shared machines)",
    )
    ap.add_argument("--write-docs", action="store_true")
    a = ap.parse_args(argv)
    rows = []
    for n in a.seq:
        tokens_per_s = {1: 0.0, 2: 0.0}
        for sp in [1, 2] * a.repeats:  # alternate; the best run of each counts
            argv_ = [
                "--mock-data",
                "--vocab-size",
                "1024",
                "--num-layers",
                str(a.layers),
                "--hidden-size",
                str(a.hidden),
                "--num-attention-heads",
                str(a.heads),
                "--seq-length",
                str(n),
                "--ds-sequence-parallel-size",
                str(sp),
                "--attention-dropout",
                "0",
                "--hidden-dropout",
                "0",
                "--train-iters",
                "1000",
                "--log-interval",
                "1000",
            ]
            per_iter, _ = run_ranks(timed_training, sp, argv_, 1, a.iters, False)[0]
            tokens_per_s[sp] = max(tokens_per_s[sp], n / per_iter)
            print(f"N={n} SP={sp}: {per_iter * 1e3:.0f} ms/iter", flush=True)
        rows.append(
            [
                n,
                f"{tokens_per_s[1]:.0f}",
                f"{tokens_per_s[2]:.0f}",
                f"{tokens_per_s[2] / tokens_per_s[1]:.2f}×",
            ]
        )
    table = markdown_table(["N", "SP=1 tokens/s", "SP=2 tokens/s", "speed-up"], rows)
    report(
        "sp-scaling",
        "Ulysses SP scaling on CPU",
        f"{a.layers} layers, hidden {a.hidden}, {a.heads} heads, micro-batch 1, fp32, dropout "
        f"off, one thread per rank (gloo); {a.iters} iterations after one warm-up.",
        table,
        write_docs=a.write_docs,
    )


if __name__ == "__main__":
    main()
