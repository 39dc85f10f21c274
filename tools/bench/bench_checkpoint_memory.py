#!/usr/bin/env python
"""Extra host memory per rank while saving a checkpoint (ZeRO-1 and ZeRO-3, DP ranks on CPU).

    python -m tools.bench.bench_checkpoint_memory [--hidden-size 512 --num-layers 16] \
        [--world 2] [--write-docs]

Each rank trains one iteration, then a sampler thread reads the process's resident set size
(/proc/self/statm) every 2 ms while save_checkpoint runs; the table gives each rank's peak
minus its RSS just before the save, next to the model's fp32 size and the rank's own shard of
model + Adam state. The dp0 rank writes its (tp, pp) part, so it holds that part whole; the
other ranks should hold about one parameter's worth.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

MB = 2 ** 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    def __init__(self):
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __enter__(self):
        self.before = _rss()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def measure(rank: int, world: int, argv: list[str], save_dir: str) -> dict:
    from megatron_ul.checkpoint.io import save_checkpoint
    from megatron_ul.mpu import parallel_state as ps
    from megatron_ul.training.pretrain import configure, setup
    trainer = setup(configure(argv, world))
    trainer.train()
    trainer.cfg.checkpoint.save = save_dir
    params = sum(p.numel() for p in trainer.model.parameters())   # global under ZeRO-3
    with PeakRSS() as probe:
        save_checkpoint(trainer.cfg, trainer.model, trainer.optimizer, trainer.scheduler, 1)
    ps.destroy_model_parallel()
    return {"rank": rank, "extra_mb": (probe.peak - probe.before) / MB,
            "model_mb": params * 4 / MB, "shard_mb": params * 12 / world / MB}


def main() -> int:
    from tools.bench.common import report, run_ranks
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=16)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--write-docs", action="store_true")
    a = p.parse_args()
    base = ["--mock-data", "--vocab-size", "1024", "--num-layers", str(a.num_layers),
            "--hidden-size", str(a.hidden_size), "--num-attention-heads", "8",
            "--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "1",
            "--log-interval", "100", "--attention-dropout", "0", "--hidden-dropout", "0"]
    rows = []
    for name, flags in [("ZeRO-1", ["--use-distributed-optimizer"]),
                        ("ZeRO-3", ["--zero-stage", "3"])]:
        with tempfile.TemporaryDirectory() as tmp:
            for r in run_ranks(measure, a.world, base + flags, tmp):
                rows.append(f"| {name} | {r['rank']} | {r['model_mb']:.0f} | "
                            f"{r['shard_mb']:.0f} | {r['extra_mb']:.0f} |")
    table = ("| optimizer | rank | model fp32 MB | own shard (model + Adam) MB | "
             "extra RSS during save MB |\n|---|---|---|---|---|\n" + "\n".join(rows))
    report("checkpoint-memory", "Host memory during a checkpoint save",
           f"{a.world} DP ranks on CPU (gloo), hidden {a.hidden_size}, {a.num_layers} layers, "
           f"one iteration, then save_checkpoint; peak RSS (sampled every 2 ms) minus RSS "
           f"before the save.", table, write_docs=a.write_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
