"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to min_lr
(Megatron-LM's OptimizerParamScheduler; step 0 uses lr 0 when there is warmup)."""

from __future__ import annotations

import math


class LRSchedule:
    def __init__(
        self,
        optimizer,
        *,
        max_lr: float,
        min_lr: float,
        warmup_steps: int,
        decay_steps: int,
        decay_style: str,
    ):
        self.optimizer, self.max_lr, self.min_lr = optimizer, max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style = decay_style
        self.num_steps = 0
        self._apply()

    def get_lr(self, step: int) -> float:
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.max_lr * step / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_steps:
            return self.min_lr
        span = max(self.decay_steps - self.warmup_steps, 1)
        ratio = (step - self.warmup_steps) / span
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    @property
    def lr(self) -> float:
        return self.get_lr(self.num_steps)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def step(self) -> None:
        self.num_steps += 1
        self._apply()

    # Everything that decides the schedule (checkpoint/training/load.py checks them on resume).
    HYPER_PARAMETERS = ("max_lr", "min_lr", "warmup_steps", "decay_steps", "decay_style")

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, **{k: getattr(self, k) for k in self.HYPER_PARAMETERS}}

    def load_state_dict(self, state: dict) -> None:
        """Position and, where saved, the schedule itself (checkpoints before the schedule was
        saved hold only num_steps)."""
        for key in self.HYPER_PARAMETERS:
            if key in state:
                setattr(self, key, state[key])
        self.num_steps = state["num_steps"]
        self._apply()
