"""The interface every storage format implements (checkpoint/storage/__init__.py holds the
table), and the records passed through it."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..files import CheckpointError
from ..full import FullCheckpoint


@dataclass
class SaveJob:
    """What a format writes: this rank's part of the model (and optimizer) into `tmp`."""

    model: Any
    optimizer: Any
    save_optim: bool
    tmp: str  # the iteration's temporary directory
    common: dict  # what every format stores once besides the tensors
    background: bool = False  # --async-save: hand back a Future instead of waiting


@dataclass
class Written:
    """This rank's outcome of a format's write: file records {path relative to the iteration
    directory: record}, its error (every rank still takes part in collectives after one), the
    stored pieces' digests, or a Future of (records, digests) while a background writer runs."""

    records: dict = field(default_factory=dict)
    error: str | None = None
    digests: dict = field(default_factory=dict)
    future: Future | None = None


@dataclass
class LoadJob:
    """What a format reads for this rank: the checked metadata of `iter_dir`, the layouts of
    the checkpoint (meta["layout"]) and of this run, and whether the optimizer is loaded."""

    meta: dict
    iter_dir: str
    run_layout: dict
    load_optim: bool
    checkpoint_dir: str  # --load, for the conversion command a resharding load suggests


@dataclass
class Opened:
    """What a format read before restoring: the common payload, the file it came from, and
    whatever the format restores from (its own)."""

    payload: dict
    source: str
    state: Any = None


class StorageFormat(Protocol):
    """One `--ckpt-format`."""

    name: str
    # metadata["optimizer"] when the optimizer is saved: whole name-keyed tensors
    # ("replicated") or pieces that any layout reads ("sharded")
    optimizer_kind: str

    def write(self, job: SaveJob) -> Written:
        """Collective over all ranks: this rank's files in job.tmp."""
        ...

    def metadata(self, digests: dict) -> dict:
        """Entries of metadata.json that only this format writes."""
        ...

    def open(self, job: LoadJob, model) -> Opened:
        """This rank's reading, without communication (checked by the loader on every rank)."""
        ...

    def restore(self, job: LoadJob, opened: Opened, model, optimizer) -> Any:
        """Restore the model (and the optimizer when job.load_optim) from what `open` read;
        may be collective. Returns a measurement of what was read, or None."""
        ...

    def read_full(
        self, meta: dict, iter_dir: str, with_optim: bool, progress: bool = False
    ) -> FullCheckpoint:
        """The whole iteration in one process, merged to TP1/PP1 (conversion, export); with
        `progress`, a line per tensor group read."""
        ...


def check_optimizer_kind(meta: dict, source: str, kind: str) -> None:
    """Refuse loading an optimizer from a checkpoint without one, or of another kind."""
    if meta.get("optimizer") is None:
        raise CheckpointError(
            f"{source}: the checkpoint holds no optimizer state (saved with "
            f"--no-save-optim, or imported); pass --no-load-optim or --finetune"
        )
    if meta["optimizer"] != kind:
        raise CheckpointError(
            f"{source}: unknown optimizer state kind {meta['optimizer']!r}; "
            f"pass --no-load-optim to start the optimizer afresh"
        )
