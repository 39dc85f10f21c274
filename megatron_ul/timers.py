"""Named wall-clock timers for the per-iteration time split (--timing-log-level).

`timers(name, level)` is a context manager. One Timers object is built per run (training/
pretrain.setup) and handed to what it times: the schedules and the training step (forward,
backward, gradient reduction, optimizer) and, through the model, the Ulysses all-to-all. Code
that is given none uses NO_TIMERS, whose every call is a shared no-op context, as is a level
above --timing-log-level. On a GPU each start/stop synchronises the device so that the time
belongs to the phase that issued the kernels (this costs a little overlap; it is why the split
is opt-in). A base module: it imports nothing from the package, so every layer may use it.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

_NULL = contextlib.nullcontext()


class Timers:
    """timers(name, level): times the block when level <= log_level; pop() returns the sums."""

    def __init__(self, log_level: int, device_type: str = "cpu"):
        self.log_level = log_level
        self.sync = device_type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def _measure(self, name: str):
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1

    def __call__(self, name: str, level: int = 1):
        return self._measure(name) if level <= self.log_level else _NULL

    def pop(self) -> tuple[dict[str, float], dict[str, int]]:
        """(seconds, calls) per name since the last pop; resets them."""
        seconds, calls = dict(self.seconds), dict(self.calls)
        self.seconds.clear()
        self.calls.clear()
        return seconds, calls


NO_TIMERS = Timers(log_level=0)
"""Times nothing (every phase has level >= 1): the default wherever timers are optional."""
