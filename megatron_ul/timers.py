"""Named timers for the per-iteration time split (--timing-log-level).

`timers(name, level)` is a context manager. One Timers object is built per run (training/
pretrain.setup) and handed to what it times: the schedules and the training step (forward,
backward, gradient reduction, optimizer) and, through the model, the Ulysses all-to-all. Code
that is given none uses NO_TIMERS, whose every call is a shared no-op context, as is a level
above --timing-log-level.

On a GPU a timed block records a pair of CUDA events on the current stream and never waits
for the device: timers sit on the per-micro-batch path (the all-to-all is timed per layer), and
a host sync there would stall the launch queue and serialise communication with compute. The
split is the device's time for each phase (from the stream reaching its start to reaching its
end). Finished events are folded into the sums as they complete (a non-blocking query), and
`pop()`, once per log interval, waits for the rest. `device_sync=True` (--timing-device-sync)
instead synchronises the device around every timed block, for a wall-clock split that
attributes every kernel to the phase that issued it, at the cost of that overlap. On the CPU
the timers read the wall clock. A base module: it imports nothing from the package, so every
layer may use it.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict, deque

import torch

_NULL = contextlib.nullcontext()


class Timers:
    """timers(name, level): times the block when level <= log_level; pop() returns the sums."""

    def __init__(self, log_level: int, device_type: str = "cpu", device_sync: bool = False):
        self.log_level = log_level
        self.cuda = device_type == "cuda"
        self.device_sync = device_sync and self.cuda
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._pending: deque = deque()  # (name, start event, end event), oldest first

    @contextlib.contextmanager
    def _measure_wall(self, name: str):
        if self.device_sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device_sync:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1

    @contextlib.contextmanager
    def _measure_events(self, name: str):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((name, start, end))
            self.calls[name] += 1
            self._collect(wait=False)

    def _collect(self, wait: bool) -> None:
        """Add finished events to the sums, oldest first; with wait, wait for all of them."""
        while self._pending:
            name, start, end = self._pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self.seconds[name] += start.elapsed_time(end) / 1e3
            self._pending.popleft()

    def __call__(self, name: str, level: int = 1):
        if level > self.log_level:
            return _NULL
        if self.cuda and not self.device_sync:
            return self._measure_events(name)
        return self._measure_wall(name)

    def pop(self) -> tuple[dict[str, float], dict[str, int]]:
        """(seconds, calls) per name since the last pop; resets them. Waits for the device
        to reach the last timed block (once per log interval)."""
        self._collect(wait=True)
        seconds, calls = dict(self.seconds), dict(self.calls)
        self.seconds.clear()
        self.calls.clear()
        return seconds, calls


NO_TIMERS = Timers(log_level=0)
"""Times nothing (every phase has level >= 1): the default wherever timers are optional."""
