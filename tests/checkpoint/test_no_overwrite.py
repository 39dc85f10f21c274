"""Nothing good is overwritten or abandoned: a lost tracker beside complete checkpoints stops
the run (it never starts from scratch over them); a run whose saves would land on complete
checkpoints stops at start-up; a save never replaces a complete checkpoint of its iteration
without --overwrite-checkpoints. Both formats."""

import os
import shutil

import pytest

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.training.save import save_checkpoint
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.conftest import copy_of
from tests.checkpoint.runs import TINY_TWO_ITERS as ARGV
from tests.checkpoint.runs import listing

FORMATS = ["torch", "torch_dist"]


@pytest.fixture(params=FORMATS)
def saved_in(request, pristine, tmp_path, single_rank):
    """(directory, format flags) of a copy of a two-iteration checkpoint."""
    return copy_of(pristine, request.param, tmp_path / "ckpt"), ["--ckpt-format", request.param]


def _checkpoints(d: str) -> dict:
    """listing() without the job lock (whose holder line every run rewrites)."""
    return {p: t for p, t in listing(d).items() if os.path.basename(p) != files.LOCK}


def _refused(argv) -> str:
    with pytest.raises(files.CheckpointError) as info:
        setup(configure(argv, 1))
    return str(info.value)


@pytest.mark.parametrize("also_save", [True, False])
def test_a_lost_tracker_stops_the_run_naming_the_newest_checkpoint(saved_in, also_save):
    d, fmt = saved_in
    tracker = os.path.join(d, files.TRACKER)
    os.remove(tracker)
    before = _checkpoints(d)
    message = _refused(ARGV + fmt + ["--load", d] + (["--save", d] if also_save else []))
    assert f"{tracker}: missing" in message and "newest iter_0000002" in message
    assert f"echo 2 > {tracker}" in message
    assert _checkpoints(d) == before


def test_starting_from_scratch_into_checkpoints_is_refused(saved_in):
    d, fmt = saved_in
    before = _checkpoints(d)
    message = _refused(ARGV + fmt + ["--save", d])
    assert "starting at iteration 0" in message and "iter_0000002" in message
    assert "--overwrite-checkpoints" in message
    assert _checkpoints(d) == before


def test_resuming_before_later_checkpoints_is_refused(saved_in, tmp_path):
    """The tracker rolled back to 2 while iter_0000004 is complete: the run's saves would
    replace it."""
    d, fmt = saved_in
    shutil.copytree(os.path.join(d, "iter_0000002"), os.path.join(d, "iter_0000004"))
    message = _refused(ARGV + fmt + ["--load", d, "--save", d])
    tracker = os.path.join(d, files.TRACKER)
    assert f"{tracker} names iteration 2" in message and "iter_0000004" in message
    assert "set back by hand" in message and f"echo 4 > {tracker}" in message
    assert "iter_0000002," not in message


def test_a_save_never_replaces_a_complete_iteration_without_the_flag(saved_in):
    d, fmt = saved_in
    trainer = setup(configure(ARGV + fmt + ["--load", d, "--save", d], 1))
    before = _checkpoints(d)
    with pytest.raises(
        files.CheckpointError,
        match="iteration 2 is already there; not replaced.*--overwrite-checkpoints",
    ):
        save_checkpoint(trainer.cfg, trainer.model, trainer.optimizer, trainer.scheduler, 2)
    assert _checkpoints(d) == before
    trainer.cfg.checkpoint.overwrite_checkpoints = True
    save_checkpoint(trainer.cfg, trainer.model, trainer.optimizer, trainer.scheduler, 2)
    assert _checkpoints(d) != before and files.is_complete(os.path.join(d, "iter_0000002"))
