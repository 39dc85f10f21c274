"""Checkpoint paths, the tracker file, and durable file writes.

Layout (Megatron-LM's, plus a metadata file and per-rank RNG files):
    DIR/latest_checkpointed_iteration.txt
    DIR/iter_0000100/metadata.json
    DIR/iter_0000100/mp_rank_00[_000]/model_optim_rng.pt     one per (tp, pp), written by dp0/sp0
                                                             (ZeRO state gathered into it)
    DIR/iter_0000100/rng/rank_00000.pt                        one per global rank
A save in progress lives in DIR/iter_0000100.tmp-<uuid> and is renamed into place when complete;
an iteration being replaced is first renamed to DIR/iter_0000100.old-<uuid>.
"""
from __future__ import annotations

import glob
import io
import json
import os
from typing import Optional

import torch

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
MODEL_FILE = "model_optim_rng.pt"
# 2: 0-based global layer names (the PP=1 module names) and `replica.` tied-embedding copies.
FORMAT = "megatron_ul-checkpoint-2"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def mp_rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def model_file(iter_dir: str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return os.path.join(iter_dir, mp_rank_dir_name(tp_rank, pp_rank, pp_size), MODEL_FILE)


def rng_file(iter_dir: str, global_rank: int) -> str:
    return os.path.join(iter_dir, "rng", f"rank_{global_rank:05d}.pt")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: str, data: bytes) -> None:
    """Write and fsync `path` (its directory must exist and be private to this save)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_torch(obj, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_bytes_durably(path, buffer.getvalue())


def load_torch(path: str, what: str):
    """torch.load with a message naming the file when it is missing or unreadable."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing ({what}); the checkpoint is incomplete — "
                              f"load an earlier iteration or re-save it")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle means a damaged file
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {e}); the file is "
                              f"corrupt or truncated — load an earlier iteration") from e


def write_json_durably(path: str, obj) -> None:
    write_bytes_durably(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing ({what}); the checkpoint is incomplete")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be parsed ({e}); the file is corrupt") from e


def check_format(meta: dict, path: str) -> None:
    """Refuse metadata written in another checkpoint format, naming the file."""
    found = meta.get("format")
    if found != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {found!r}, this megatron_ul reads "
                              f"{FORMAT!r} (format 1 used 1-based layer names); re-save or "
                              f"re-import it with this version")


def write_tracker(save_dir: str, iteration: int) -> None:
    """Point the tracker at `iteration` atomically: write a temporary file, then os.replace."""
    tmp = os.path.join(save_dir, f".{TRACKER}.tmp-{os.getpid()}")
    write_bytes_durably(tmp, f"{iteration}\n".encode())
    os.replace(tmp, os.path.join(save_dir, TRACKER))
    fsync_dir(save_dir)


def read_tracker(load_dir: str) -> Optional[int]:
    """The latest complete iteration, or None when no save has completed in `load_dir`."""
    path = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text[:40]!r}; "
                              f"write the iteration of a complete iter_XXXXXXX directory "
                              f"into it") from None


def unfinished_saves(load_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(load_dir, "iter_*.tmp-*")))


def find_iteration_dir(load_dir: str, iteration: int) -> str:
    """The directory of a complete iteration. A save killed between renaming an older copy of
    the same iteration aside and renaming the new one in leaves only the `.old-` copy: use it."""
    path = os.path.join(load_dir, iteration_dir_name(iteration))
    if os.path.isdir(path):
        return path
    aside = sorted(glob.glob(path + ".old-*"))
    if aside:
        return aside[-1]
    raise CheckpointError(f"{os.path.join(load_dir, TRACKER)} names iteration {iteration} but "
                          f"{path} does not exist; restore that directory or point the tracker "
                          f"at an existing iter_XXXXXXX")
