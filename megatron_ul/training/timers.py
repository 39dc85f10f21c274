"""Named wall-clock timers for the per-iteration time split (--timing-log-level).

`timer(name, level)` is a context manager. The active Timers object is process-global (set by
the metrics logger for the duration of training); with none installed, or a level above
--timing-log-level, it is a shared no-op context. On a GPU each start/stop synchronises the
device so that the time belongs to the phase that issued the kernels (this costs a little
overlap; it is why the split is opt-in).
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

_NULL = contextlib.nullcontext()


class Timers:
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


_active: Timers | None = None


def set_timers(timers: Timers | None) -> None:
    global _active
    _active = timers


def get_timers() -> Timers | None:
    return _active


def timer(name: str, level: int = 1):
    """with timer('forward'): ...  — a no-op unless timers at this level are on."""
    if _active is None or level > _active.log_level:
        return _NULL
    return _active(name, level)
