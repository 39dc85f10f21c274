"""Storage formats of a training checkpoint: one module per `--ckpt-format` behind one
interface (StorageFormat), looked up by name in FORMATS.

A format decides which files hold the tensors and the common state (iteration, schedule, data
position, args): `torch` gathers each (tp, pp) part on its dp0/sp0 rank into one torch.save
file, `torch_dist` has every rank write its own pieces through torch.distributed.checkpoint.
Everything else a save or load does (locking, RNG files, checksums, metadata.json, publishing,
resume rules) is the same for every format and lives in checkpoint/training.
"""

from __future__ import annotations

import types

from ..files import CheckpointError
from . import torch_dist, torch_files
from .base import StorageFormat

FORMATS: types.MappingProxyType[str, StorageFormat] = types.MappingProxyType(
    {f.name: f for f in (torch_files.TorchFiles(), torch_dist.TorchDist())}
)


def storage_format(name: str) -> StorageFormat:
    """The format `--ckpt-format name` writes."""
    try:
        return FORMATS[name]
    except KeyError:
        raise CheckpointError(
            f"--ckpt-format {name!r}: unknown storage format; choose one of {sorted(FORMATS)}"
        ) from None


def format_of(meta: dict, source: str) -> StorageFormat:
    """The format a checkpoint was written in (metadata.json's "storage"; checkpoints from
    before it was recorded are torch files)."""
    name = meta.get("storage", torch_files.TorchFiles.name)
    try:
        return FORMATS[name]
    except KeyError:
        raise CheckpointError(
            f"{source}: unknown storage format {name!r} (known: {sorted(FORMATS)}); was it "
            f"written by a newer megatron_ul?"
        ) from None
