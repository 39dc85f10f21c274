"""Progress of a long conversion, one line per tensor group (a stage file, a shard, a
parameter with its moments) on stderr, so that a tool's stdout stays its result."""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def tensor_groups(groups: Iterable[T], total: int, what: str, show: bool = True) -> Iterator[T]:
    """Yield `groups` and, when `show`, print after each how many of `total` are done, the
    rate and an ETA."""
    start, done = time.monotonic(), 0
    for group in groups:
        yield group
        done += 1
        if show:
            elapsed = max(time.monotonic() - start, 1e-9)
            print(
                f"{what}: {done} of {total} tensor groups ({done / elapsed:.2f} groups/s, "
                f"ETA {elapsed * (total - done) / done:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
