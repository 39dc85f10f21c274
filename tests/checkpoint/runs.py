"""Module-level functions run on spawned gloo ranks by the checkpoint tests."""
from __future__ import annotations

import os

import torch.distributed as dist

from megatron_ul.checkpoint import files
from megatron_ul.mpu import parallel_state as ps
from megatron_ul.training.pretrain import configure, setup

TINY = ["--mock-data", "--vocab-size", "200", "--make-vocab-size-divisible-by", "16",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--min-lr", "1e-4", "--seed", "7",
        "--log-interval", "100", "--distributed-timeout-minutes", "1.5", "--adam-eps", "1e-6"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


def train(rank: int, world: int, argv: list[str]) -> list[float]:
    losses = setup(configure(argv, world)).train()
    ps.destroy_model_parallel()
    return losses


def train_then_resume(rank: int, world: int, argv: list[str], save_dir: str, k: int,
                      iters: int) -> tuple[list[float], list[float]]:
    """Uninterrupted run of `iters` (saving every k), then a run resumed from iteration k."""
    full = train(rank, world, argv + ["--train-iters", str(iters), "--save", save_dir,
                                      "--save-interval", str(k)])
    dist.barrier()
    if rank == 0:   # make iteration k the latest, as if the first run had stopped there
        files.write_tracker(save_dir, k)
    dist.barrier()
    resumed = train(rank, world, argv + ["--train-iters", str(iters), "--load", save_dir])
    return full, resumed


def load_error(rank: int, world: int, argv: list[str]) -> str:
    """The message of the error that setting up (loading) with `argv` raises, or ''."""
    try:
        setup(configure(argv, world))
    except Exception as e:  # noqa: BLE001 - the test inspects the message
        return f"{type(e).__name__}: {e}"
    finally:
        ps.destroy_model_parallel()
    return ""


def listing(root: str) -> dict[str, float]:
    """{path: mtime} of everything under root (to show nothing was overwritten or deleted)."""
    out = {}
    for base, dirs, names in os.walk(root):
        for n in dirs + names:
            path = os.path.join(base, n)
            out[path] = os.stat(path).st_mtime_ns
    return out
