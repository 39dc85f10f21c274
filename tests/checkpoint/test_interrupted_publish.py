"""A save stopped at any step — a kill (no clean-up runs after it) or a full disk — leaves a
directory that the requeued job (--load D --save D) restarts from by itself: from the new
iteration once its directory had been renamed into place, from the previous one before; the
weights it resumes with are bit-equal to those saved; nothing complete is changed, and no
interrupted-save record is left behind.

Every os-level step of the save is enumerated: each file opened for writing, each mkdir, each
rename and replace, each fsync; k-th step by k-th step, in both formats and with --async-save.
The disk-full trials fill a real tmpfs (root only; otherwise a stand-in raising ENOSPC at every
write from the k-th on) across the checkpoint's size."""

from __future__ import annotations

import builtins
import errno
import hashlib
import io
import logging
import os
import shutil
import subprocess
import uuid
from contextlib import contextmanager

import pytest
import torch

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.training.save import PendingSave, save_checkpoint
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.runs import TINY as _TINY

TINY = _TINY + ["--lr-decay-iters", "2"]  # the pristine checkpoint's schedule, run longer

CASES = {  # name: (format flags, background save)
    "torch": (["--ckpt-format", "torch"], False),
    "torch_dist": (["--ckpt-format", "torch_dist"], False),
    "torch_dist_async": (["--ckpt-format", "torch_dist", "--async-save"], True),
}


class Killed(BaseException):
    """The process died here: not an Exception, so no handler of the save's catches it."""


class Faults:
    """Counts the save's os-level steps under `root`; from the k-th on the process is dead
    (every further step raises Killed, so nothing more reaches the disk) or, with
    enospc=True, every further write fails with ENOSPC (renames and removals still work,
    as on a full disk)."""

    WRITE_MODES = set("wax+")

    def __init__(self, root: str, k: int | None, enospc: bool = False):
        self.root, self.k, self.enospc = os.path.realpath(root), k, enospc
        self.steps: list[str] = []
        self.fired = False

    def _under(self, path) -> bool:
        try:
            return os.path.realpath(os.fspath(path)).startswith(self.root)
        except TypeError:
            return False  # a file descriptor

    def _step(self, what: str, writes: bool) -> None:
        self.steps.append(what)
        if self.k is not None and len(self.steps) >= self.k:
            if not self.fired:
                self.fired = True
            if self.enospc:
                if writes:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), what)
                return
            raise Killed(what)

    @contextmanager
    def active(self):
        real = {
            name: getattr(os, name)
            for name in ("rename", "replace", "fsync", "mkdir", "remove", "unlink", "rmdir")
        }
        real_open = builtins.open

        def path_op(name, writes):
            def op(*args, **kwargs):
                if self._under(args[0]) or (self.fired and not self.enospc):
                    two = name in ("rename", "replace")
                    target = f" -> {os.path.basename(args[1])}" if two else ""
                    self._step(f"{name} {os.path.basename(os.fspath(args[0]))}{target}", writes)
                return real[name](*args, **kwargs)

            return op

        def fsync(fd):
            self._step(f"fsync {fd}", True)
            return real["fsync"](fd)

        def opener(file, mode="r", *args, **kwargs):
            if self._under(file) and (self.WRITE_MODES & set(mode)):
                self._step(f"open {os.path.basename(os.fspath(file))}", True)
            return real_open(file, mode, *args, **kwargs)

        patches = {
            **{name: path_op(name, name == "mkdir") for name in real if name != "fsync"},
            "fsync": fsync,
        }
        try:
            for name, fn in patches.items():
                setattr(os, name, fn)
            builtins.open = io.open = opener  # type: ignore[assignment]
            yield self
        finally:
            for name, fn in real.items():
                setattr(os, name, fn)
            builtins.open = io.open = real_open  # type: ignore[assignment]


def _digest_tree(d: str, skip=()) -> dict[str, str]:
    out = {}
    for root, _, names in os.walk(d):
        for n in names:
            p = os.path.join(root, n)
            if n not in skip:
                out[os.path.relpath(p, d)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class Trial:
    """One case: a saver holding the run at iteration 3 (trained from the pristine checkpoint
    of iteration 2), and the weights of iterations 2 and 3 to compare resumed runs with."""

    def __init__(self, pristine: dict, case: str, tmp_path):
        self.flags, self.background = CASES[case]
        self.fmt = self.flags[1]
        self.base = str(tmp_path / "base")
        shutil.copytree(pristine[self.fmt], self.base)
        files.release_save_dir(self.base)
        argv = TINY + self.flags + ["--load", self.base, "--train-iters", "3"]
        self.saver = setup(configure(argv, 1))
        self.at = {2: _params(self.saver.model)}
        self.saver.train()  # iteration 3; no --save: nothing written
        self.at[3] = _params(self.saver.model)
        assert not torch.equal(next(iter(self.at[2].values())), next(iter(self.at[3].values())))
        self.pristine_files = _digest_tree(os.path.join(self.base, "iter_0000002"))

    def fresh_dir(self, parent: str) -> str:
        d = os.path.join(parent, f"ckpt-{uuid.uuid4().hex[:6]}")
        shutil.copytree(self.base, d, ignore=shutil.ignore_patterns(files.LOCK))
        return d

    def save(self, d: str) -> None:
        """Save iteration 3 into d (as training's save does, completing an async save)."""
        self.saver.cfg.checkpoint.save = d
        try:
            out = save_checkpoint(
                self.saver.cfg,
                self.saver.model,
                self.saver.optimizer,
                self.saver.scheduler,
                3,
                background=self.background,
            )
            if isinstance(out, PendingSave):
                out.complete()
        finally:
            self.saver.cfg.checkpoint.save = None

    def restart(self, d: str, caplog) -> int:
        """The requeued job: --load D --save D. Returns its start iteration after checking
        the weights it loaded, the untouched iteration 2 and the directory's tidiness."""
        caplog.clear()
        argv = TINY + self.flags + ["--load", d, "--save", d, "--train-iters", "4"]
        with caplog.at_level(logging.INFO, logger="megatron_ul"):
            trainer = setup(configure(argv, 1))
        files.release_save_dir(d)
        start = trainer.start_iteration
        assert start in (2, 3)
        got = _params(trainer.model)
        assert all(torch.equal(got[n], self.at[start][n]) for n in got), start
        assert _digest_tree(os.path.join(d, "iter_0000002")) == self.pristine_files
        assert files.read_tracker(d) == start
        assert files.is_complete(os.path.join(d, files.iteration_dir_name(start)))
        leftovers = [n for n in os.listdir(d) if n.startswith(f".{files.TRACKER}")]
        assert not leftovers, leftovers
        said = [r.getMessage() for r in caplog.records if "interrupted save" in r.getMessage()]
        assert len(said) <= 1, said
        return start


def _kill_sweep(trial: Trial, tmp_path, caplog, ks) -> list[tuple[int, str, int]]:
    """(k, step killed at, resumed iteration) for each k in ks."""
    out = []
    for k in ks:
        d = trial.fresh_dir(str(tmp_path))
        faults = Faults(d, k)
        with pytest.raises((Killed, files.CheckpointError)), faults.active():
            trial.save(d)
        files.release_save_dir(d)  # the kernel drops a dead process's lock
        had_intent = bool(files.interrupted_publishes(d))
        start = trial.restart(d, caplog)
        if had_intent:
            assert any("interrupted save" in r.getMessage() for r in caplog.records)
        out.append((k, faults.steps[-1], start))
        shutil.rmtree(d)
    return out


def _steps_of_a_save(trial: Trial, tmp_path) -> list[str]:
    d = trial.fresh_dir(str(tmp_path))
    faults = Faults(d, None)
    with faults.active():
        trial.save(d)
    files.release_save_dir(d)
    shutil.rmtree(d)
    return faults.steps


def _check_sweep(steps: list[str], results: list[tuple[int, str, int]]) -> None:
    """Until the publish intent is written the run resumes at 2; once it is (even before the
    directory's rename) at 3."""
    intent = next(i for i, s in enumerate(steps, 1) if s.startswith(f"open .{files.TRACKER}"))
    assert steps.index(next(s for s in steps if s.startswith("rename iter_0000003.tmp-"))) >= intent
    print("\n".join(f"k={k:3d} {step:60s} -> {start}" for k, step, start in results))
    for k, step, start in results:
        assert start == (3 if k > intent else 2), (k, step, start)


@pytest.mark.parametrize("case", list(CASES))
def test_a_kill_at_any_publish_step_restarts_by_itself(
    case, pristine, tmp_path, single_rank, caplog
):
    """Default suite: every step from the metadata write on (the publish); --run-slow sweeps
    every step of the save (test below)."""
    trial = Trial(pristine, case, tmp_path)
    steps = _steps_of_a_save(trial, tmp_path)
    first = next(i for i, s in enumerate(steps, 1) if s == f"open {files.METADATA}")
    results = _kill_sweep(trial, tmp_path, caplog, range(first, len(steps) + 1))
    _check_sweep(steps, results)
    assert any(start == 2 for _, _, start in results)
    # A finished save needs no recovery; the restart resumes at 3, saying nothing.
    d = trial.fresh_dir(str(tmp_path))
    trial.save(d)
    files.release_save_dir(d)
    assert trial.restart(d, caplog) == 3
    assert not any("interrupted save" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_kill_at_any_step_of_a_save_restarts_by_itself(
    case, pristine, tmp_path, single_rank, caplog
):
    trial = Trial(pristine, case, tmp_path)
    steps = _steps_of_a_save(trial, tmp_path)
    _check_sweep(steps, _kill_sweep(trial, tmp_path, caplog, range(1, len(steps) + 1)))


@pytest.mark.parametrize("case", ["torch", "torch_dist"])
def test_a_full_disk_at_any_write_restarts_by_itself(case, pristine, tmp_path, single_rank, caplog):
    """Stand-in for a full disk: from the k-th step on every write fails with ENOSPC. The save
    fails as a message naming the disk's error; the restart resumes without a person."""
    trial = Trial(pristine, case, tmp_path)
    steps = _steps_of_a_save(trial, tmp_path)
    writes = [i for i, s in enumerate(steps, 1) if s.startswith(("open", "fsync", "mkdir"))]
    for k in writes:
        d = trial.fresh_dir(str(tmp_path))
        with pytest.raises(files.CheckpointError) as info, Faults(d, k, enospc=True).active():
            trial.save(d)
        files.release_save_dir(d)
        assert "No space left on device" in str(info.value), (k, str(info.value))
        trial.restart(d, caplog)
        shutil.rmtree(d)


def _tmpfs(path: str, size: int) -> bool:
    os.makedirs(path, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True
        ).returncode
        == 0
    )


@pytest.mark.parametrize("case", ["torch", "torch_dist"])
def test_a_real_full_disk_across_the_checkpoint_size(case, pristine, tmp_path, single_rank, caplog):
    """A real tmpfs just large enough for the previous checkpoint plus 0 … all of the new one
    (in 4 KiB pages): the save fails as a message or succeeds, and the requeued job restarts
    on the still-full disk without a person."""
    if os.geteuid() != 0 or not _tmpfs(str(tmp_path / "probe"), 1 << 20):
        pytest.skip("mounting a tmpfs needs root")
    subprocess.run(["umount", str(tmp_path / "probe")], check=True)
    trial = Trial(pristine, case, tmp_path)
    page = 4096

    def pages(d):
        return sum(
            -(-os.path.getsize(os.path.join(r, n)) // page) for r, _, ns in os.walk(d) for n in ns
        )

    d = trial.fresh_dir(str(tmp_path))
    before = pages(d)
    trial.save(d)
    files.release_save_dir(d)
    new = pages(os.path.join(d, "iter_0000003")) + 4
    shutil.rmtree(d)
    outcomes = []
    # Across the new checkpoint's size, and page by page at its end (the publish's steps).
    sizes = sorted(
        {(before + 1 + n * new // 6) * page for n in range(7)}
        | {(before + new - n) * page for n in range(8)}
    )
    for size in sizes:
        mnt = str(tmp_path / f"mnt{size}")
        assert _tmpfs(mnt, size)
        try:
            d = trial.fresh_dir(mnt)
            try:
                trial.save(d)
                outcome = "saved"
            except files.CheckpointError as e:
                assert "No space left on device" in str(e), str(e)
                print(e)
                outcome = "full"
            files.release_save_dir(d)
            outcomes.append((size, outcome, trial.restart(d, caplog)))
        finally:
            subprocess.run(["umount", mnt], check=True)
    print(outcomes)
    assert outcomes[0][1] == "full" and outcomes[-1][1] == "saved"


def test_a_load_only_run_finishes_the_interrupted_save(pristine, tmp_path, single_rank, caplog):
    """Killed at the tracker's move; the next run only --loads the directory (no job holds
    its lock): it finishes the save and resumes at the new iteration."""
    trial = Trial(pristine, "torch", tmp_path)
    d = trial.fresh_dir(str(tmp_path))
    steps = _steps_of_a_save(trial, tmp_path)
    k = next(i for i, s in enumerate(steps, 1) if s.startswith("replace .latest"))
    with pytest.raises(Killed), Faults(d, k).active():
        trial.save(d)
    files.release_save_dir(d)
    assert files.read_tracker(d) == 2 and files.interrupted_publishes(d)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_ul"):
        trainer = setup(configure(TINY + trial.flags + ["--load", d, "--train-iters", "4"], 1))
    assert trainer.start_iteration == 3 and files.read_tracker(d) == 3
    assert not files.interrupted_publishes(d)
    assert os.path.realpath(d) not in files.held_save_dirs()  # taken for the recovery only
    said = [r.getMessage() for r in caplog.records if "interrupted save" in r.getMessage()]
    assert len(said) == 1 and "now names iteration 3 (it named 2)" in said[0]


def test_torch_dist_names_the_os_error_of_a_full_disk(
    pristine, tmp_path, single_rank, monkeypatch, caplog
):
    """A disk that fills inside torch.save's zip writer (which replaces the OSError by
    "unexpected pos"): the message names the .distcp file and the OS error."""
    trial = Trial(pristine, "torch_dist", tmp_path)
    d = trial.fresh_dir(str(tmp_path))
    real = io.FileIO

    class Full(real):  # type: ignore[misc,valid-type]
        def write(self, b):
            if os.path.basename(self.name).endswith(".distcp") and self.tell() + len(b) > 256:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(b)

    monkeypatch.setattr(io, "FileIO", Full)
    with pytest.raises(files.CheckpointError) as info:
        trial.save(d)
    monkeypatch.setattr(io, "FileIO", real)
    message = str(info.value)
    assert "__0_0.distcp: cannot be written (No space left on device)" in message, message
    assert "unexpected pos" not in message
    files.release_save_dir(d)
    assert trial.restart(d, caplog) == 2


def test_an_interrupted_save_whose_files_are_short_is_rolled_back(
    pristine, tmp_path, single_rank, caplog
):
    """Killed at the tracker's move, and the new iteration's model file later found short:
    the restart rolls back to iteration 2, saying why."""
    trial = Trial(pristine, "torch", tmp_path)
    d = trial.fresh_dir(str(tmp_path))
    steps = _steps_of_a_save(trial, tmp_path)
    k = next(i for i, s in enumerate(steps, 1) if s.startswith("replace .latest"))
    with pytest.raises(Killed), Faults(d, k).active():
        trial.save(d)
    files.release_save_dir(d)
    model = files.model_file(os.path.join(d, "iter_0000003"), 0, 0, 1)
    os.truncate(model, os.path.getsize(model) // 2)
    assert trial.restart(d, caplog) == 2
    said = [r.getMessage() for r in caplog.records if "interrupted save" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("rolled back an interrupted save of iteration 3")
    assert model in said[0]


def test_an_intent_never_publishes_another_saves_directory(pristine, tmp_path):
    """An intent whose save's directory is gone (removed after a failure) while an older
    complete copy of the iteration is in place: that copy is not taken for the new save."""
    d = shutil.copytree(pristine["torch"], str(tmp_path / "ckpt"))
    intent = files.write_intent(d, 2, "feedbeef0000")
    lines = files.recover_publish(d)
    assert len(lines) == 1 and lines[0].startswith("rolled back an interrupted save of iteration 2")
    assert "written by another save" in lines[0] and not os.path.exists(intent)
    assert files.read_tracker(d) == 2 and files.is_complete(os.path.join(d, "iter_0000002"))
