"""Progress of a long conversion, one line per tensor group (a stage file, a torch_dist
parameter with its moments) on stderr through the shared reporter (megatron_ul/progress.py),
so that a tool's stdout stays its result."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from ..progress import Progress
from . import files

T = TypeVar("T")


def tensor_groups(
    groups: Iterable[T],
    total: int,
    what: str,
    show: bool = True,
    size: Callable[[T], int] | None = None,
) -> Iterator[T]:
    """Yield `groups` and, when `show`, report after each (once the caller has handled it) how
    many of `total` are done, the rate (bytes from `size(group)`, e.g. the file just written)
    and an ETA."""
    progress = Progress(
        "tensor groups",
        interval=1,
        rate_unit="groups",
        total=total,
        verb=f"{what}:",
        stream=None if show else io.StringIO(),
    )
    for group in groups:
        yield group
        progress.update(1, size(group) if size is not None and show else 0)


def stage_file_size(iter_dir: str, pp: int) -> Callable[[tuple[int, int]], int]:
    """size() for groups (pp rank, tp rank) of stage files in `iter_dir`: the file's bytes."""

    def size(part: tuple[int, int]) -> int:
        return os.path.getsize(files.model_file(iter_dir, part[1], part[0], pp))

    return size
