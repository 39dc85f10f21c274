"""Checkpoint paths, the tracker file, and durable file writes.

Layout (Megatron-LM's directory and file naming; the contents are our own — see
checkpoint/interop/megatron_lm.py for Megatron-LM's legacy format):
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


def load_torch(path: str, what: str, expected: dict | None = None):
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
    except Exception as e:
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


def read_tracker(load_dir: str) -> int | None:
    """The latest complete iteration, or None when no save has completed in `load_dir`;
    CheckpointError naming the file when it holds anything but a non-negative iteration."""
    path = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            text = f.read(100).decode(errors="replace").strip()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from e
    if not text.isascii() or not text.isdigit():
        raise CheckpointError(
            f"{path}: expected an iteration number, found {text[:40]!r}; "
            f"write the iteration of a complete iter_XXXXXXX directory "
            f"into it"
        )
    return int(text)


# ---- publishing an iteration: the intent, and finishing it after a crash ---------------------
# Publishing iteration N renames iter_N.tmp-<id> to iter_N and then moves the tracker. A kill
# or a full disk between the two would leave a newer complete iter_N behind an older tracker,
# which is also what a person rolling the tracker back leaves. So before the first rename the
# save writes the tracker's next contents, "N\n", durably into DIR/PUBLISHING + <id> (the
# intent); the tracker is then moved by renaming that file over it, which needs no free space.
# A file of that name therefore means: a publish of N was under way and did not finish. The
# next start (recover_publish) finishes it when the new iteration is complete and every file's
# size matches metadata.json (whose own SHA-256 matches), and otherwise rolls it back; the
# tracker never moves back.
PUBLISHING = f".{TRACKER}.publish-"


def intent_path(save_dir: str, save_id: str) -> str:
    return os.path.join(save_dir, PUBLISHING + save_id)


def write_intent(save_dir: str, iteration: int, save_id: str) -> str:
    """Record (durably) that iteration `iteration` of save `save_id` is being published."""
    path = intent_path(save_dir, save_id)
    write_bytes_durably(path, f"{iteration}\n".encode())
    fsync_dir(save_dir)
    return path


def verify_iteration(iter_dir: str) -> str | None:
    """None when `iter_dir` is complete: metadata.json matches its own SHA-256 and every file
    it records is there at its recorded size; else what is wrong. The files' SHA-256 are
    checked by the load that follows, as each file is read: hashing a whole large checkpoint
    here, on rank 0 while the other ranks wait in a collective, could outlast
    --distributed-timeout-minutes. (The intent is written only after every file was fsynced,
    so a kill leaves none of them short or changed.)"""
    try:
        meta = read_metadata(iter_dir)
    except CheckpointError as e:
        return str(e)
    for rel, record in meta["files"].items():
        path = os.path.join(iter_dir, rel)
        if not os.path.isfile(path):
            return f"{path}: missing"
        size, recorded = os.path.getsize(path), record.get("bytes")
        if size != recorded:
            return f"{path}: {size} bytes, metadata.json records {recorded}"
    return None


def recover_publish(save_dir: str) -> list[str]:
    """Finish or roll back every publish a kill or a full disk interrupted in `save_dir` (call
    only while holding its lock); returns one line per publish saying what was done. Raises
    CheckpointError, naming the file, when the directory cannot be changed (the next start
    tries again)."""
    done = []
    try:
        for path in sorted(glob.glob(os.path.join(save_dir, f".{TRACKER}.tmp-*"))):
            os.remove(path)  # a tracker write that never reached its rename
        intents = sorted(glob.glob(os.path.join(save_dir, PUBLISHING + "*")))
        for intent in intents:
            done.append(_recover_one(save_dir, intent))
        if intents:
            fsync_dir(save_dir)
    except OSError as e:
        raise CheckpointError(
            f"{e.filename or save_dir}: finishing an interrupted save failed "
            f"({e.strerror or e}); check the free space and permissions of {save_dir}"
        ) from e
    return done


def _recover_one(save_dir: str, intent: str) -> str:
    save_id = os.path.basename(intent)[len(PUBLISHING) :]
    with open(intent, "rb") as f:
        text = f.read(100).decode(errors="replace").strip()
    tracker = os.path.join(save_dir, TRACKER)
    current = read_tracker(save_dir)
    if not text.isdigit():  # killed while writing the intent: the renames never started
        os.remove(intent)
        return f"{intent}: an unfinished record of a save, removed; {_tracker_says(current)}"
    iteration = int(text)
    final = os.path.join(save_dir, iteration_dir_name(iteration))
    tmp, aside = f"{final}.tmp-{save_id}", f"{final}.old-{save_id}"
    published = not os.path.isdir(tmp)  # the tmp directory had been renamed into place
    candidate = final if published else tmp
    problem = verify_iteration(candidate) if os.path.isdir(candidate) else f"{candidate}: missing"
    if problem is None:  # the directory this save wrote, not an older copy of the iteration
        meta = read_metadata(candidate)
        if (meta.get("iteration"), meta.get("save_id", save_id)) != (iteration, save_id):
            problem = f"{candidate}: written by another save"
    if problem is None and (current is None or current <= iteration):
        if not published:
            if os.path.isdir(final) and not os.path.isdir(aside):
                os.rename(final, aside)
            os.rename(tmp, final)
            fsync_dir(save_dir)
        os.replace(intent, tracker)  # the intent holds the tracker's new contents
        fsync_dir(save_dir)
        if os.path.isdir(aside):
            remove_dir(aside, save_id)
        return (
            f"recovered an interrupted save: {final} is complete (every file metadata.json "
            f"records is there at its size); {tracker} now names iteration {iteration} (it named "
            f"{'nothing' if current is None else current})"
        )
    # Roll back: the previous copy of the iteration (if one was set aside) returns.
    if os.path.isdir(aside) and not os.path.isdir(final):
        os.rename(aside, final)
    os.remove(intent)
    why = problem or f"{tracker} already names the later iteration {current}"
    return (
        f"rolled back an interrupted save of iteration {iteration} ({why}); "
        f"{_tracker_says(current)}"
    )


def _tracker_says(current: int | None) -> str:
    return (
        "no checkpoint had completed before it"
        if current is None
        else f"resuming from iteration {current}, the newest complete checkpoint"
    )


def interrupted_publishes(save_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(save_dir, PUBLISHING + "*")))


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


def held_save_dirs() -> set[str]:
    """The (real) paths of the directories whose lock this process holds."""
    return set(_held_locks)


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


def lost_tracker_error(load_dir: str) -> CheckpointError | None:
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
