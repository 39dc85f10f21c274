"""The layout-free form of one checkpoint iteration: what conversions, exports and imports pass
between reading and writing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FullCheckpoint:
    """One iteration merged to TP1/PP1: unpadded full tensors keyed by canonical name."""

    metadata: dict
    common: dict  # iteration, scheduler, consumed samples, args
    params: dict
    optim_state: dict | None  # name -> {exp_avg, exp_avg_sq, step}
    optim_groups: list | None  # hyper-parameters and param_names per group
