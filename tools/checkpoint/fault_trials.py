"""The fault-injection suite of `python -m tools.checkpoint.kill_trial --suite`: kill -9 during
saves, corrupted files and a full disk, for the torch and torch_dist formats and
--async-save (see kill_trial's docstring for what each trial checks)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess

import torch

from tools.checkpoint.kill_trial import check_loadable, load_and_release, one_trial, start_child

CELLS = [("torch", False), ("torch_dist", False), ("torch_dist", True)]
DAMAGES = ("truncate", "flip", "delete")
CAUSES = ("No space left on device", "File too large")


def suite(root: str, kill_trials: int, seed: int, max_delay: float) -> int:
    import logging

    logging.basicConfig(level=logging.ERROR)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    rng, rows = random.Random(seed), []
    for fmt_name, background in CELLS:
        fmt = ["--ckpt-format", fmt_name]
        label = fmt_name + (", `--async-save`" if background else "")
        pristine = os.path.join(root, f"pristine-{fmt_name}-{int(background)}")
        fill(pristine, fmt, background, saves=2)
        size = tree_bytes(os.path.join(pristine, "iter_0000002"))
        rows.append(
            (
                "kill -9 during saves",
                label,
                kill_cell(os.path.join(root, "kill"), kill_trials, rng, fmt, background, max_delay),
            )
        )
        if not background:  # --async-save writes the same files
            rows.append(("corruption", label, corruption_cell(root, pristine)))
        rows.append(
            (
                "disk full",
                label,
                disk_full_cell(root, fmt, background, size, max(2, kill_trials // 2), rng),
            )
        )
    print("\n| fault | format | trials | held | failed |\n|---|---|---|---|---|")
    for fault, label, results in rows:
        held = sum(results)
        print(f"| {fault} | {label} | {len(results)} | {held} | {len(results) - held} |")
    return 0 if all(all(r) for _, _, r in rows) else 1


def fill(
    directory: str, fmt: list[str], background: bool, saves: int, file_size_limit: int = 0
) -> tuple[list[int], str]:
    """Run the child saving iterations 1..saves into `directory`: (saved iterations, the
    failure line's message or '')."""
    proc = start_child(directory, fmt, background, fill=saves, file_size_limit=file_size_limit)
    out, _ = proc.communicate(timeout=300)
    words = [line.split(" ", 2) for line in out.splitlines()]
    saved = [int(w[1]) for w in words if w[0] == "saved"]
    failure = next((w[2] if len(w) > 2 else "" for w in words if w[0] == "failed"), "")
    return saved, failure


def tree_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(base, n)) for base, _, names in os.walk(path) for n in names
    )


def kill_cell(
    directory: str,
    trials: int,
    rng: random.Random,
    fmt: list[str],
    background: bool,
    max_delay: float,
) -> list[bool]:
    shutil.rmtree(directory, ignore_errors=True)
    results = []
    for trial in range(trials):
        r = one_trial(directory, max_delay, rng, fmt, background)
        ok, detail = check_loadable(directory, r["last_saved"])
        print(
            f"kill {' '.join(fmt)}{' async' if background else ''} {trial + 1}: killed after "
            f"{r['delay']:.2f}s {'mid-save' if r['mid_save'] else 'between saves'}, last "
            f"reported save {r['last_saved']}: {'held' if ok else 'FAILED'} ({detail})",
            flush=True,
        )
        results.append(ok)
    return results


def _loaded(directory: str):
    from megatron_ul.checkpoint.state import named_parameters

    return load_and_release(
        directory,
        lambda trainer: (
            trainer.start_iteration,
            {
                n: p.detach().clone()
                for n, p in named_parameters(trainer.model, trainer.optimizer).items()
            },
        ),
    )


def _damage(path: str, how: str) -> None:
    if how == "delete":
        os.remove(path)
        return
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[: len(data) // 2]
    elif data:
        data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


def corruption_cell(root: str, pristine: str) -> list[bool]:
    """Every file of the newest iteration and the tracker, each damaged three ways."""
    from megatron_ul.checkpoint import files

    reference = _loaded(pristine)
    newest = os.path.join(pristine, "iter_0000002")
    kinds = sorted(
        os.path.relpath(os.path.join(base, n), pristine)
        for base, _, names in os.walk(newest)
        for n in names
    ) + [files.TRACKER]
    results = []
    for kind in kinds:
        for how in DAMAGES:
            trial = os.path.join(root, "corrupt")
            shutil.rmtree(trial, ignore_errors=True)
            shutil.copytree(pristine, trial)
            path = os.path.join(trial, kind)
            _damage(path, how)
            try:
                iteration, params = _loaded(trial)
            except files.CheckpointError as e:
                ok, detail = path in str(e), f"refused: {str(e)[:150]}"
            except Exception as e:
                ok, detail = False, f"{type(e).__name__}: {str(e)[:150]}"
            else:
                ok = iteration == reference[0] and all(
                    torch.equal(params[n], reference[1][n]) for n in reference[1]
                )
                detail = f"loaded iteration {iteration}, {'identical' if ok else 'DIFFERENT'}"
            print(f"corrupt {kind} ({how}): {'held' if ok else 'FAILED'} ({detail})", flush=True)
            results.append(ok)
    return results


def _mount_tmpfs(path: str, size: int) -> bool:
    os.makedirs(path, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True
        ).returncode
        == 0
    )


def disk_full_cell(
    root: str, fmt: list[str], background: bool, size: int, trials: int, rng: random.Random
) -> list[bool]:
    """Saves into a tmpfs of 1.2-2.8 checkpoints until one fails (without mount rights: every
    file limited to 0.3-0.9 checkpoints by RLIMIT_FSIZE, so the first save fails)."""
    results = []
    for trial in range(trials):
        mount_point = os.path.join(root, "full")
        mounted = _mount_tmpfs(mount_point, int(size * rng.uniform(1.2, 2.8)))
        limit = 0 if mounted else int(size * rng.uniform(0.3, 0.9))
        directory = os.path.join(mount_point, "ckpt")
        try:
            saved, failure = fill(directory, fmt, background, saves=20, file_size_limit=limit)
            left = [n for n in os.listdir(directory) if ".tmp-" in n]
            loads, detail = check_loadable(directory, saved[-1] if saved else None)
        finally:
            if mounted:
                subprocess.run(["umount", mount_point], check=True)
            shutil.rmtree(mount_point, ignore_errors=True)
        ok = bool(failure) and any(c in failure for c in CAUSES) and not left and loads
        print(
            f"disk full {' '.join(fmt)}{' async' if background else ''} {trial + 1} "
            f"({'tmpfs' if mounted else 'RLIMIT_FSIZE'}): saved {saved}, "
            f"{'held' if ok else 'FAILED'}; error: {failure[:200]!r}; tmp left {left}; "
            f"load: {detail}",
            flush=True,
        )
        results.append(ok)
    return results
