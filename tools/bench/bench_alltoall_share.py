#!/usr/bin/env python
"""Share of an iteration spent in the Ulysses all-to-all as the SP degree P and the sequence
length N grow (small hidden size, so communication is as visible as it gets), measured with
the --timing-log-level 1 timers on rank 0 (gloo, one thread per rank, CPU).

On a machine with fewer cores than ranks, an all-to-all also waits for the slowest peer, so
the share includes that imbalance; the column 'cores' says when ranks outnumber cores.

    python -m tools.bench.bench_alltoall_share [--sizes 2 4] [--seq 1024 2048 4096 8192] \
        [--write-docs]
"""

import argparse
import os

from tools.bench.common import markdown_table, report, run_ranks, timed_training


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--write-docs", action="store_true")
    a = ap.parse_args(argv)
    rows = []
    for p in a.sizes:
        for n in a.seq:
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
                str(p),
                "--attention-dropout",
                "0",
                "--hidden-dropout",
                "0",
                "--train-iters",
                "1000",
                "--log-interval",
                "1000",
            ]
            per_iter, phases = run_ranks(timed_training, p, argv_, 1, a.iters, True)[0]
            a2a = phases.get("all-to-all", 0.0)
            rows.append(
                [
                    p,
                    n,
                    f"{per_iter * 1e3:.0f}",
                    f"{phases.get('forward', 0) * 1e3:.0f}",
                    f"{phases.get('backward', 0) * 1e3:.0f}",
                    f"{a2a * 1e3:.1f}",
                    f"{a2a / per_iter:.1%}",
                    f"{min(p, os.cpu_count())}/{p}",
                ]
            )
            print(rows[-1], flush=True)
    table = markdown_table(
        [
            "SP",
            "N",
            "ms/iter",
            "forward ms",
            "backward ms",
            "all-to-all ms",
            "all-to-all share",
            "cores",
        ],
        rows,
    )
    report(
        "alltoall-share",
        "All-to-all share of an iteration",
        f"{a.layers} layers, hidden {a.hidden}, {a.heads} heads, micro-batch 1, fp32, dropout "
        f"off; {a.iters} iterations after one warm-up, rank 0's timers.",
        table,
        write_docs=a.write_docs,
    )


if __name__ == "__main__":
    main()
