"""Weights & Biases beside TensorBoard, with Megatron-LM's flags: --wandb-project turns it on,
--wandb-exp-name names the run, --wandb-save-dir (default --save/wandb) holds W&B's local files.
The run's whole configuration is the W&B config; the scalars are TensorBoard's, with the same
tags and the iteration as W&B's step. Only the reporting rank (the last pipeline stage's first
rank) writes.

wandb is optional: without --wandb-project it is never imported; with the flag and without the
package the start-up stops with a message naming the flag.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

from ..config import Config


def wandb_problems(cfg: Config) -> list[str]:
    """What stops --wandb-project from working on this machine, each naming its flag."""
    lg = cfg.logging
    if not lg.wandb_project:
        given = [
            name
            for name, value in (
                ("--wandb-exp-name", lg.wandb_exp_name),
                ("--wandb-save-dir", lg.wandb_save_dir),
            )
            if value
        ]
        return [f"{name} needs --wandb-project (W&B is off without it)" for name in given]
    found = []
    if importlib.util.find_spec("wandb") is None:
        found.append(
            f"--wandb-project {lg.wandb_project}: the wandb package is not installed "
            "(pip install wandb), or drop the flag"
        )
    if not lg.wandb_exp_name:
        found.append("--wandb-project needs --wandb-exp-name (the run's name in W&B)")
    save_dir = wandb_save_dir(cfg)
    if save_dir is None:
        found.append(
            "--wandb-project needs --wandb-save-dir (or --save, whose wandb/ folder is the "
            "default) for W&B's local files"
        )
    elif os.path.exists(save_dir) and not os.path.isdir(save_dir):
        flag = "--wandb-save-dir" if lg.wandb_save_dir else "--save"
        found.append(f"{flag}: {save_dir} exists and is not a directory; choose another path")
    return found


def wandb_save_dir(cfg: Config) -> str | None:
    """--wandb-save-dir, else --save/wandb as Megatron-LM has it, else None."""
    if cfg.logging.wandb_save_dir:
        return cfg.logging.wandb_save_dir
    if cfg.checkpoint.save:
        return os.path.join(cfg.checkpoint.save, "wandb")
    return None


def config_dict(cfg: Config) -> dict[str, Any]:
    """The configuration as W&B config: one nested section per concern, as in --help."""
    return dataclasses.asdict(cfg)


class WandbWriter:
    """SummaryWriter's add_scalar/flush/close on a W&B run: the scalars of one iteration are
    gathered and logged as one row at that step (W&B merges later rows at the same step)."""

    def __init__(self, cfg: Config):
        import wandb

        save_dir = wandb_save_dir(cfg)
        assert save_dir is not None, "configure() checks --wandb-save-dir"
        os.makedirs(save_dir, exist_ok=True)
        self._run = wandb.init(
            project=cfg.logging.wandb_project,
            name=cfg.logging.wandb_exp_name,
            dir=save_dir,
            config=config_dict(cfg),
        )
        self._row: dict[str, float] = {}
        self._step: int | None = None

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self._step is not None and step != self._step:
            self.flush()
        self._row[tag] = float(value)
        self._step = step

    def flush(self) -> None:
        if self._row:
            self._run.log(self._row, step=self._step)
        self._row, self._step = {}, None

    def close(self) -> None:
        self.flush()
        self._run.finish()
