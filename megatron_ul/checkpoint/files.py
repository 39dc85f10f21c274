"""Checkpoint paths, the tracker file, and durable file writes.

Layout (Megatron-LM's directory and file naming; the contents are our own — see
checkpoint/megatron_lm.py for Megatron-LM's legacy format):
    DIR/latest_checkpointed_iteration.txt
    DIR/iter_0000100/metadata.json
    DIR/iter_0000100/mp_rank_00[_000]/model_optim_rng.pt     one per (tp, pp), written by dp0/sp0
                                                             (ZeRO state gathered into it)
    DIR/iter_0000100/rng/rank_00000.pt                        one per global rank
A save in progress lives in DIR/iter_0000100.tmp-<uuid> and is renamed into place when complete;
an iteration being replaced is first renamed to DIR/iter_0000100.old-<uuid>; a directory being
deleted is first renamed to DIR/iter_0000100.del-<uuid>, which no loader ever considers.
metadata.json lists every other file of the iteration with its size and SHA-256, checked when
the file is read (a file it does not list is not read), and carries the SHA-256 of its own
contents (metadata_sha256). DIR/.megatron_ul.lock is held (POSIX lock) by the job saving into DIR.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import io
import json
import os
import socket
import time
from typing import Optional

import torch

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
MODEL_FILE = "model_optim_rng.pt"
COMMON_FILE = "common.pt"  # torch_dist: what is stored once besides the tensors
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
    """Write and fsync `path` (its directory must exist and be private to this save). Disk
    full, quota and permission errors name the path."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise CheckpointError(
            f"{path}: cannot be written ({e.strerror or e}); check the free "
            f"space, quota and permissions of {os.path.dirname(path)}"
        ) from e


def file_record(data: bytes) -> dict:
    """What metadata.json records of a file: its size and SHA-256."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def save_torch(obj, path: str) -> dict:
    """torch.save durably; returns the file's record (file_record)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"{os.path.dirname(path)}: cannot be created "
            f"({e.strerror or e}); check the permissions and free space"
        ) from e
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    write_bytes_durably(path, data)
    return file_record(data)


def expected_record(meta: dict, iter_dir: str, path: str) -> dict:
    """The record metadata.json holds for `path`; CheckpointError when it holds none (a file
    without a record is never read unchecked)."""
    record = meta["files"].get(os.path.relpath(path, iter_dir))
    if record is None:
        raise CheckpointError(
            f"{path}: not among the files {os.path.join(iter_dir, METADATA)} "
            f"records; the checkpoint is inconsistent — not loaded"
        )
    return record


def load_torch(path: str, what: str, expected: Optional[dict] = None):
    """torch.load with a message naming the file when it is missing, unreadable or (with
    `expected`, its file_record) not the bytes that were saved."""
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path}: missing ({what}); the checkpoint is incomplete — "
            f"load an earlier iteration or re-save it"
        )
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from e
    if expected is not None:
        found = file_record(data)
        if found != expected:
            raise CheckpointError(
                f"{path}: corrupt — {found['bytes']} bytes with SHA-256 "
                f"{found['sha256'][:16]}…, metadata.json recorded "
                f"{expected['bytes']} bytes with {expected['sha256'][:16]}…; "
                f"not loaded: restore the file or load an earlier iteration"
            )
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle means a damaged file
        raise CheckpointError(
            f"{path}: cannot be read ({type(e).__name__}: {e}); the file is "
            f"corrupt or truncated — load an earlier iteration"
        ) from e


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
        raise CheckpointError(
            f"{path}: checkpoint format {found!r}, this megatron_ul reads "
            f"{FORMAT!r} (format 1 used 1-based layer names); re-save or "
            f"re-import it with this version"
        )


SELF_SHA = "metadata_sha256"  # metadata.json's checksum of its other entries


def _metadata_digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != SELF_SHA}
    return hashlib.sha256(json.dumps(body, indent=1, sort_keys=True).encode()).hexdigest()


def write_metadata(iter_dir: str, meta: dict) -> None:
    """metadata.json, sealed with the SHA-256 of its own contents."""
    write_json_durably(os.path.join(iter_dir, METADATA), {**meta, SELF_SHA: _metadata_digest(meta)})


def read_metadata(iter_dir: str) -> dict:
    """metadata.json of an iteration directory, checked: its own checksum, its format, and a
    record of the files (every file read later must have one)."""
    path = os.path.join(iter_dir, METADATA)
    meta = read_json(path, "checkpoint metadata")
    if not isinstance(meta, dict) or meta.get(SELF_SHA) != _metadata_digest(meta):
        found = meta.get(SELF_SHA) if isinstance(meta, dict) else None
        raise CheckpointError(
            f"{path}: corrupt — its contents do not match the SHA-256 it "
            f"carries ({str(found or 'none')[:16]}…); written by another "
            f"version or edited — not loaded: restore the file or load an "
            f"earlier iteration"
        )
    check_format(meta, path)
    if not isinstance(meta.get("files"), dict):
        raise CheckpointError(
            f"{path}: records no files; the checkpoint is inconsistent — not loaded"
        )
    return meta


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
    text = open(path, "rb").read().decode(errors="replace").strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(
            f"{path}: expected an iteration number, found {text[:40]!r}; "
            f"write the iteration of a complete iter_XXXXXXX directory "
            f"into it"
        ) from None


def unfinished_saves(load_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(load_dir, "iter_*.tmp-*")))


def is_complete(iter_dir: str) -> bool:
    """metadata.json parses and every file it records is there with its recorded size (a
    directory whose deletion was interrupted fails this)."""
    try:
        meta = read_metadata(iter_dir)
    except CheckpointError:
        return False
    return all(
        os.path.isfile(p) and os.path.getsize(p) == record["bytes"]
        for p, record in (
            (os.path.join(iter_dir, rel), record) for rel, record in meta["files"].items()
        )
    )


def find_iteration_dir(load_dir: str, iteration: int) -> str:
    """The directory of a complete iteration. A save killed between renaming an older copy of
    the same iteration aside and renaming the new one in leaves only `.old-` copies: use the
    newest complete one (an interrupted cleanup may have left a partial one beside it)."""
    path = os.path.join(load_dir, iteration_dir_name(iteration))
    if os.path.isdir(path):
        return path
    aside = [d for d in glob.glob(path + ".old-*") if is_complete(d)]
    if aside:
        return max(aside, key=os.path.getmtime)
    raise CheckpointError(
        f"{os.path.join(load_dir, TRACKER)} names iteration {iteration} but "
        f"{path} does not exist; restore that directory or point the tracker "
        f"at an existing iter_XXXXXXX"
    )


def remove_dir(path: str, save_id: str) -> None:
    """Delete a directory so that a kill at any moment leaves either the whole directory under
    its old name or a `.del-` directory no loader considers: rename first, then delete."""
    doomed = f"{path}.del-{save_id}"
    os.rename(path, doomed)
    rmtree_quietly(doomed)


def rmtree_quietly(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ---- one job per save directory ---------------------------------------------------------------
LOCK = ".megatron_ul.lock"
_held_locks: dict[str, int] = {}


def claim_save_dir(save_dir: str) -> None:
    """Hold DIR/.megatron_ul.lock for the life of this process (a POSIX lock: released by the
    kernel when the process dies, kill -9 included, and honoured over NFS); CheckpointError
    naming the holder when another process holds it."""
    key = os.path.realpath(save_dir)
    if key in _held_locks:
        return
    path = os.path.join(save_dir, LOCK)
    try:
        os.makedirs(save_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise CheckpointError(
            f"{path}: cannot be created ({e.strerror or e}); check the "
            f"permissions of --save {save_dir}"
        ) from e
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise CheckpointError(
            f"--save {save_dir} is in use by {holder} (it holds {path}); two "
            f"jobs saving into one directory would interleave their "
            f"checkpoints: give this job its own --save directory"
        ) from None
    os.ftruncate(fd, 0)
    os.write(
        fd,
        f"pid {os.getpid()} on {socket.gethostname()} since "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}".encode(),
    )
    _held_locks[key] = fd


def release_save_dir(save_dir: str) -> None:
    """Drop this process's lock on `save_dir` (process exit does it too)."""
    fd = _held_locks.pop(os.path.realpath(save_dir), None)
    if fd is not None:
        os.close(fd)


def stale_temporaries(save_dir: str) -> list[str]:
    """Unfinished saves, copies set aside and half-deleted directories: stale once a newer
    save has completed (call only while holding the directory's lock)."""
    return sorted(
        d
        for pattern in ("iter_*.tmp-*", "iter_*.old-*", "iter_*.del-*")
        for d in glob.glob(os.path.join(save_dir, pattern))
    )


def complete_iterations(save_dir: str) -> list[int]:
    """The iterations in `save_dir` whose directory is complete (is_complete), ascending."""
    found = []
    for d in glob.glob(os.path.join(save_dir, "iter_" + "[0-9]" * 7)):
        if is_complete(d):
            found.append(int(os.path.basename(d)[5:]))
    return sorted(found)


def lost_tracker_error(load_dir: str) -> Optional[CheckpointError]:
    """With no tracker, complete iterations in `load_dir` mean the tracker was lost, not that
    nothing was saved: starting from scratch would abandon them (and later overwrite them)."""
    complete = complete_iterations(load_dir)
    if not complete:
        return None
    tracker = os.path.join(load_dir, TRACKER)
    return CheckpointError(
        f"{tracker}: missing, but {load_dir} holds complete checkpoints "
        f"(newest {iteration_dir_name(complete[-1])}); not starting from "
        f"scratch over them — to resume from the newest: echo "
        f"{complete[-1]} > {tracker}"
    )
