"""Module-level functions run on spawned gloo ranks by the torch_dist checkpoint tests."""

from __future__ import annotations

import functools
import math
import os
import time

import torch
from torch.distributed.checkpoint import FileSystemReader

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.storage import pieces
from megatron_ul.checkpoint.training.load import last_load_report
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.runs import _on_rank0, convert_cli, train

DIST = ["--ckpt-format", "torch_dist"]
ZERO1 = ["--use-distributed-optimizer"]
ZERO3 = ["--zero-stage", "3"]


def resume_on_other_layouts(
    rank: int, world: int, argv: list[str], source: list[str], targets: dict, tmp: str
) -> dict:
    """Train 4 iterations on `source` (torch_dist, saving at 2), then resume from iteration 2 on
    each target layout (resharded on load). Returns each run's losses (the original first)."""
    src = os.path.join(tmp, "src")
    run = lambda flags: train(rank, world, argv + DIST + ["--train-iters", "4"] + flags)  # noqa
    out = {"original": run(source + ["--save", src, "--save-interval", "2"])}
    _on_rank0(lambda: files.write_tracker(src, 2))
    for name, flags in targets.items():
        out[name] = run(flags + ["--load", src])
    return out


def bytes_read_on_layout_change(
    rank: int,
    world: int,
    argv: list[str],
    source: list[str],
    target: list[str],
    tmp: str,
    block_bytes: int,
) -> dict:
    """Save on `source` with stored pieces of at most `block_bytes`, load on `target`, and
    report what this rank read (checkpoint/dcp_pieces.LoadReport), the stored tensor bytes, and
    the losses of the original run, of the run resumed on the target layout and of a run
    resumed (DP) from the checkpoint converted offline to TP1 in the torch format."""
    pieces.BLOCK_BYTES = block_bytes
    src = os.path.join(tmp, "src")
    original = train(
        rank,
        world,
        argv + DIST + source + ["--train-iters", "4", "--save", src, "--save-interval", "2"],
    )
    _on_rank0(lambda: files.write_tracker(src, 2))
    resumed = train(rank, world, argv + DIST + target + ["--train-iters", "4", "--load", src])
    report = last_load_report[0]
    converted = os.path.join(tmp, "tp1_torch")
    _on_rank0(
        lambda: convert_cli(
            ["--load-dir", src, "--save-dir", converted, "--target-tensor-parallel-size", "1"]
        )
    )
    from_converted = train(rank, world, argv + ["--train-iters", "4", "--load", converted])
    metadata = FileSystemReader(os.path.join(src, "iter_0000002")).read_metadata()
    stored = sum(
        math.prod(c.sizes) * 4 for md in metadata.state_dict_metadata.values() for c in md.chunks
    )  # every stored tensor is fp32
    return {
        "report": report,
        "stored_tensor_bytes": stored,
        "original": original,
        "resumed": resumed,
        "converted_to_tp1_torch": from_converted,
    }


def async_against_sync(
    rank: int, world: int, argv: list[str], tmp: str, write_delay: float
) -> dict:
    """The same run saving at 2 and 4 synchronously and with --async-save whose writer is
    slowed by `write_delay` s: losses, the iterations that finished while the asynchronous
    write of iteration 2 was in flight, whether both saves load the same tensors, and the
    losses of a run resumed from the asynchronous save of iteration 2."""
    from torch.distributed.checkpoint import FileSystemWriter

    from megatron_ul.training import exit as run_control

    sync_dir, async_dir = os.path.join(tmp, "sync"), os.path.join(tmp, "async")
    flags = argv + DIST + ["--train-iters", "4", "--save-interval", "2"]
    sync_losses = train(rank, world, flags + ["--save", sync_dir])

    events: list = []
    write_data = FileSystemWriter.write_data

    def slow_write(self, plan, planner):
        time.sleep(write_delay)
        result = write_data(self, plan, planner)
        events.append(("written", str(self.path), time.monotonic()))
        return result

    after = run_control.RunControl.after_iteration

    def record(self, iteration):
        events.append(("iteration", iteration, time.monotonic()))
        return after(self, iteration)

    FileSystemWriter.write_data, run_control.RunControl.after_iteration = slow_write, record
    try:
        async_losses = train(rank, world, flags + ["--save", async_dir, "--async-save"])
    finally:
        FileSystemWriter.write_data, run_control.RunControl.after_iteration = write_data, after
    written_2 = next(t for kind, what, t in events if kind == "written" and "iter_0000002" in what)
    started_2 = next(t for kind, what, t in events if kind == "iteration" and what == 2)
    overlapped = [
        what for kind, what, t in events if kind == "iteration" and started_2 < t < written_2
    ]
    _on_rank0(functools.partial(files.write_tracker, async_dir, 2))
    resumed = train(rank, world, argv + DIST + ["--train-iters", "4", "--load", async_dir])
    tensors = {}
    for name, directory in (("sync", sync_dir), ("async", async_dir)):
        for iteration in (2, 4):
            _on_rank0(functools.partial(files.write_tracker, directory, iteration))
            tensors[(name, iteration)] = load_tensors(rank, world, argv, directory)
    same = {
        iteration: _same(tensors[("sync", iteration)], tensors[("async", iteration)])
        for iteration in (2, 4)
    }
    return {
        "sync": sync_losses,
        "async": async_losses,
        "overlapped": overlapped,
        "same_tensors": same,
        "resumed_from_async_2": resumed,
    }


def _same(a: list, b: list) -> bool:
    return [k for k, _ in a] == [k for k, _ in b] and all(
        torch.equal(x, y) for (_, x), (_, y) in zip(a, b)
    )


def load_tensors(rank: int, world: int, argv: list[str], load: str) -> list:
    """The parameters and optimizer state a run loads from `load` (on this rank)."""
    from megatron_ul.checkpoint.storage.dcp_pieces import held_tensors

    trainer = setup(configure(argv + DIST + ["--train-iters", "4", "--load", load], world))
    held = [(h.key, h.data.clone()) for h in held_tensors(trainer.model, trainer.optimizer, True)]
    return held
