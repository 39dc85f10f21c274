#!/usr/bin/env python
"""Extra host memory per rank while saving a checkpoint and while loading it into another
layout: the torch format against torch_dist, ZeRO-1 and ZeRO-3, DP ranks on CPU.

    python -m tools.bench.bench_checkpoint_memory [--hidden-size 1024 --num-layers 24] \
        [--formats torch torch_dist] [--world 2] [--write-docs]

Save: each rank trains one iteration on DP `world` (ZeRO-1 or ZeRO-3), then a sampler thread
reads the process's resident set size (/proc/self/statm) every 2 ms while save_checkpoint runs.
Load: fresh processes build the model on TP `world` (the same optimizer, a layout change) and
load_checkpoint runs under the same sampler. The table gives each rank's peak minus its RSS
just before, next to the rank's own shard (its part of the model, of the gradients' buffer and
of the Adam moments) — what the rank holds anyway. A load that creates the optimizer state
counts that state (the rank's own moments) as extra. torch_dist writes and reads pieces of at
most one block (checkpoint/pieces.BLOCK_BYTES).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

MB = 2**20


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


def _held_mb(trainer) -> float:
    """What this rank holds: its parameters, gradients and Adam moments (local parts)."""
    from torch.distributed.tensor import DTensor

    def local(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(trainer.model.parameters())
    inner = trainer.optimizer.torch_optimizer
    moments = sum(
        local(v)
        for s in inner.state.values()
        for k, v in s.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    grads = sum(local(p) for p in params)  # a gradient per parameter (ZeRO-1: the buffer)
    return (sum(local(p) for p in params) + grads + moments) / MB


def save_phase(rank: int, world: int, argv: list[str], save_dir: str) -> dict:
    from megatron_ul.checkpoint.training.save import save_checkpoint
    from megatron_ul.training.pretrain import configure, setup

    trainer = setup(configure(argv, world))
    trainer.train()
    trainer.cfg.checkpoint.save = save_dir
    params = sum(p.numel() for p in trainer.model.parameters())  # global under ZeRO-3
    held = _held_mb(trainer)
    with PeakRSS() as probe:
        save_checkpoint(trainer.cfg, trainer.model, trainer.optimizer, trainer.scheduler, 1)
    return {
        "rank": rank,
        "extra_mb": (probe.peak - probe.before) / MB,
        "held_mb": held,
        "params": params,
    }


def load_phase(rank: int, world: int, argv: list[str], load_dir: str) -> dict:
    from megatron_ul.checkpoint.training.load import load_checkpoint
    from megatron_ul.training.pretrain import configure, setup

    trainer = setup(configure(argv, world))
    trainer.cfg.checkpoint.load = load_dir
    before_state = _held_mb(trainer)
    with PeakRSS() as probe:
        load_checkpoint(trainer.cfg, trainer.model, trainer.optimizer, trainer.scheduler)
    held = _held_mb(trainer)
    return {
        "rank": rank,
        "extra_mb": (probe.peak - probe.before) / MB,
        "held_mb": held,
        "state_created_mb": held - before_state,
    }


def main() -> int:
    from tools.bench.common import report, run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--world", type=int, default=2)
    p.add_argument(
        "--formats", nargs="+", default=["torch", "torch_dist"], choices=["torch", "torch_dist"]
    )
    p.add_argument("--section", default="checkpoint-memory")
    p.add_argument("--write-docs", action="store_true")
    a = p.parse_args()
    from megatron_ul.checkpoint.storage import pieces

    base = [
        "--mock-data",
        "--vocab-size",
        "1024",
        "--num-layers",
        str(a.num_layers),
        "--hidden-size",
        str(a.hidden_size),
        "--num-attention-heads",
        "8",
        "--seq-length",
        "64",
        "--micro-batch-size",
        "1",
        "--train-iters",
        "1",
        "--log-interval",
        "100",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--lr-decay-iters",
        "10",
    ]
    tp = ["--tensor-model-parallel-size", str(a.world)]
    rows, params = [], 0
    for fmt in a.formats:
        for name, flags in [
            ("ZeRO-1", ["--use-distributed-optimizer"]),
            ("ZeRO-3", ["--zero-stage", "3"]),
        ]:
            argv = base + flags + ["--ckpt-format", fmt]
            with tempfile.TemporaryDirectory() as tmp:
                saves = run_ranks(save_phase, a.world, argv, tmp)
                loads = run_ranks(load_phase, a.world, argv + tp, tmp)
            params = saves[0]["params"]
            for s, ld in zip(saves, loads):
                rows.append(
                    f"| {fmt} | {name} | {s['rank']} | {s['held_mb']:.0f} | "
                    f"{s['extra_mb']:.0f} ({s['extra_mb'] / s['held_mb']:.2f}) | "
                    f"{ld['held_mb']:.0f} | {ld['state_created_mb']:.0f} | "
                    f"{ld['extra_mb']:.0f} ({ld['extra_mb'] / ld['held_mb']:.2f}) |"
                )
    table = (
        "| format | optimizer | rank | save: rank holds MB | extra RSS during save MB "
        "(/ holds) | load on TP" + str(a.world) + ": rank holds MB | of which Adam state "
        "the load created MB | extra RSS during load MB (/ holds) |\n"
        "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
    )
    report(
        a.section,
        "Host memory during a checkpoint save and a layout-changing load",
        f"{params / 1e6:.0f}M parameters (hidden {a.hidden_size}, {a.num_layers} layers), "
        f"{a.world} ranks on CPU (gloo). Save: DP{a.world} after one iteration; load: "
        f"fresh processes on TP{a.world} with the same ZeRO stage. Peak RSS (sampled every "
        f"2 ms) minus RSS before; 'holds' = the rank's parameters, gradients and Adam "
        f"moments. torch_dist block: {pieces.BLOCK_BYTES // MB} MB.",
        table,
        write_docs=a.write_docs,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
