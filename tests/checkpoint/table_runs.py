"""Spawned-rank body of the parameter-table round trip (test_param_table.py)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.layout import reshard
from megatron_ul.checkpoint.training.save import save_checkpoint
from megatron_ul.pipeline.param_table import parameter_table
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.runs import _on_rank0


def _layout(flags: list[str]) -> tuple[int, int, int | None]:
    def value(flag, default):
        return int(flags[flags.index(flag) + 1]) if flag in flags else default

    return (
        value("--tensor-model-parallel-size", 1),
        value("--pipeline-model-parallel-size", 1),
        value("--num-layers-per-virtual-pipeline-stage", None),
    )


def _save(world: int, argv: list[str], directory: str) -> dict:
    """Build the model of `argv`, save it as iteration 1; metadata of the saved checkpoint."""
    trainer = setup(configure(argv + ["--save", directory], world))
    trainer.cfg.checkpoint.save = directory
    iter_dir = save_checkpoint(trainer.cfg, trainer.model, trainer.optimizer, trainer.scheduler, 1)
    return files.read_json(os.path.join(iter_dir, files.METADATA), "")


def round_trip(
    rank: int, world: int, argv: list[str], source: list[str], target: list[str], tmp: str
) -> dict:
    """Save in layout `source`, convert offline to `target`, load there and save again.
    Returns, per stage of the trip, whether the recorded table equals the one built from the
    model config on the meta device, and whether every tensor came back unchanged."""
    a, b, c = (os.path.join(tmp, n) for n in ("a", "b", "c"))
    saved = _save(world, argv + source, a)
    model = reshard.model_config(saved)
    out = {"saved": saved["params"] == parameter_table(model, *_layout(source))}

    def convert():
        tp, pp, vp = _layout(target)
        reshard.convert(a, b, tp, pp, vp=vp)

    _on_rank0(convert)
    converted = files.read_json(os.path.join(b, "iter_0000001", files.METADATA), "")
    out["converted"] = converted["params"] == parameter_table(model, *_layout(target))
    trainer = setup(configure(argv + target + ["--load", b, "--save", c], world))
    iter_dir = save_checkpoint(trainer.cfg, trainer.model, trainer.optimizer, trainer.scheduler, 1)
    reloaded = files.read_json(os.path.join(iter_dir, files.METADATA), "")
    out["loaded"] = reloaded["params"] == converted["params"]
    dist.barrier()
    first, last = reshard.read_full(os.path.join(a, "iter_0000001")), reshard.read_full(iter_dir)
    out["tensors"] = (
        first.params.keys() == last.params.keys()
        and all(torch.equal(first.params[n], last.params[n]) for n in first.params)
        and all(
            torch.equal(first.optim_state[n][k], last.optim_state[n][k])
            for n in first.optim_state
            for k in ("exp_avg", "exp_avg_sq")
        )
    )
    return out


def round_trips(rank: int, world: int, argv: list[str], cases: dict, tmp: str) -> dict:
    return {
        name: round_trip(rank, world, argv + model, source, target, os.path.join(tmp, name))
        for name, (model, source, target) in cases.items()
    }
