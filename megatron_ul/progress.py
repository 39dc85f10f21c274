"""Progress of a long operation in the ecosystem's way: every `interval` items a line with the
count, items/s and MB/s (Megatron-LM's preprocess_data prints "Processed N documents (x docs/s,
y MB/s)."), then the share done and an ETA when the total is known; one summary at the end.

Used by tools/preprocess_data.py (documents) and the checkpoint converters (tensor groups).
Lines go to stderr so that a tool's stdout stays its result.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    """Counts items, bytes and any named extras (e.g. tokens); reports every `interval` items.

    unit: what an item is ("documents", "tensor groups"); rate_unit: its short form per second
    ("docs"). total_bytes / total: the input's size or item count, for the share done and the
    ETA (position, when given to update(), is the bytes read so far, which can run ahead of
    the bytes counted).
    """

    def __init__(
        self,
        unit: str,
        interval: int = 1000,
        *,
        rate_unit: str | None = None,
        total_bytes: int | None = None,
        total: int | None = None,
        verb: str = "processed",
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if interval < 1:
            raise ValueError(f"progress interval {interval}: must be >= 1")
        self.unit, self.rate_unit, self.verb = unit, rate_unit or unit, verb
        self.interval, self.total_bytes, self.total = interval, total_bytes, total
        self.stream, self.clock = stream, clock
        self.start = clock()
        self.count = self.bytes = self.position = 0
        self.extras: dict[str, int] = {}
        self._next = interval

    def update(self, count: int = 1, nbytes: int = 0, position: int | None = None, **extras):
        """Adds `count` items of `nbytes` bytes (and extras, e.g. tokens=...); prints a line
        when the count crosses a multiple of the interval."""
        self.count += count
        self.bytes += nbytes
        self.position = max(self.position, self.bytes if position is None else position)
        for name, value in extras.items():
            self.extras[name] = self.extras.get(name, 0) + value
        if self.count >= self._next:
            self._next = (self.count // self.interval + 1) * self.interval
            self._print(f"{self.verb} {self.count} {self.unit}: {self.rates()}, {self.eta()}")

    def elapsed(self) -> float:
        return max(self.clock() - self.start, 1e-9)

    def rates(self) -> str:
        elapsed = self.elapsed()
        rate = self.count / elapsed
        parts = [
            f"{rate:.0f} {self.rate_unit}/s" if rate >= 10 else f"{rate:.2f} {self.rate_unit}/s",
            f"{self.bytes / elapsed / 1e6:.2f} MB/s",
        ]
        parts += [f"{value / elapsed / 1e6:.3f} M {name}/s" for name, value in self.extras.items()]
        return ", ".join(parts)

    def done_fraction(self) -> float | None:
        if self.total_bytes:
            return min(self.position / self.total_bytes, 1.0)
        if self.total:
            return min(self.count / self.total, 1.0)
        return None

    def eta(self) -> str:
        done = self.done_fraction()
        if not done:
            return "ETA unknown"
        remaining = self.elapsed() * (1 - done) / done
        share = "of input" if self.total_bytes else f"of {self.total} {self.unit}"
        return f"{100 * done:.1f}% {share}, ETA {remaining:.0f} s"

    def summary(self, detail: str = "") -> None:
        """The closing line: time, count, `detail` (e.g. what was skipped) and the rates."""
        detail = f" ({detail})" if detail else ""
        self._print(
            f"done in {self.elapsed():.2f} s: {self.count} {self.unit}{detail}; {self.rates()}"
        )

    def _print(self, line: str) -> None:
        print(line, file=self.stream or sys.stderr, flush=True)
