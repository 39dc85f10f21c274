"""Bad checkpoints give a message naming the file and what is wrong, and nothing existing is
overwritten or deleted: a missing directory, a save that never finished, a missing rank file,
another model's checkpoint, corrupt files, a tracker pointing nowhere, and conversions that
would overwrite."""

import logging
import os
import shutil

import pytest

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.layout.reshard import convert
from megatron_ul.config import ConfigError
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.runs import TINY_TWO_ITERS as ARGV
from tests.checkpoint.runs import listing


def _load_error(argv) -> str:
    with pytest.raises(Exception) as info:
        setup(configure(argv, 1))
    return str(info.value)


def _unchanged(root, action):
    before = listing(root)
    result = action()
    assert listing(root) == before, "a failed load or conversion changed files"
    return result


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match=f"--load {tmp_path}/nope: no such directory"):
        configure(ARGV + ["--load", str(tmp_path / "nope")], 1)
    # a requeued job's first run: --load and --save name the directory it is about to create
    configure(ARGV + ["--load", str(tmp_path / "new"), "--save", str(tmp_path / "new")], 1)


def test_unfinished_save_only_starts_from_scratch_and_says_so(tmp_path, single_rank, caplog):
    partial = tmp_path / "iter_0000002.tmp-0123abcd"
    (partial / "mp_rank_00").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="megatron_ul"):
        trainer = _unchanged(
            str(tmp_path), lambda: setup(configure(ARGV + ["--load", str(tmp_path)], 1))
        )
    assert trainer.start_iteration == 0
    assert str(partial) in caplog.text and "no complete checkpoint" in caplog.text


@pytest.mark.parametrize(
    "victim", ["mp_rank_00/model_optim_rng.pt", "rng/rank_00000.pt", "metadata.json"]
)
def test_missing_file_is_named(saved, victim):
    path = os.path.join(saved, "iter_0000002", victim)
    os.remove(path)
    message = _unchanged(saved, lambda: _load_error(ARGV + ["--load", saved]))
    assert path in message and "missing" in message


def test_other_model_shapes_are_named(saved):
    message = _unchanged(
        saved, lambda: _load_error([a if a != "32" else "64" for a in ARGV] + ["--load", saved])
    )
    assert os.path.join(saved, "iter_0000002", "metadata.json") in message
    assert "--hidden-size: checkpoint 32, this run 64" in message


@pytest.mark.parametrize("victim", ["mp_rank_00/model_optim_rng.pt", "metadata.json"])
def test_corrupt_file_is_named(saved, victim):
    path = os.path.join(saved, "iter_0000002", victim)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    message = _unchanged(saved, lambda: _load_error(ARGV + ["--load", saved]))
    assert path in message and "corrupt" in message


def test_tracker_pointing_nowhere(saved):
    files.write_tracker(saved, 7)
    message = _unchanged(saved, lambda: _load_error(ARGV + ["--load", saved]))
    assert "iter_0000007 does not exist" in message and files.TRACKER in message


def test_no_optimizer_state_asks_for_flag(tmp_path, single_rank):
    d = str(tmp_path / "weights_only")
    setup(configure(ARGV + ["--save", d, "--no-save-optim"], 1)).train()
    assert "--no-load-optim or --finetune" in _load_error(ARGV + ["--load", d])
    resumed = setup(configure(ARGV + ["--load", d, "--no-load-optim"], 1))
    # As in Megatron-LM: the iteration continues, the LR schedule starts again at step 0.
    assert resumed.start_iteration == 2 and resumed.scheduler.num_steps == 0


def test_conversion_never_overwrites(saved, tmp_path):
    with pytest.raises(files.CheckpointError, match="must differ"):
        convert(saved, saved, 1, 1)
    target = str(tmp_path / "out")
    shutil.copytree(saved, target)
    with pytest.raises(files.CheckpointError, match="iter_0000002 already exists"):
        _unchanged(target, lambda: convert(saved, target, 1, 1))


def test_saving_an_existing_iteration_replaces_it_whole(saved, single_rank):
    trainer = setup(configure(ARGV + ["--save", saved, "--overwrite-checkpoints"], 1))
    old = listing(saved)
    from megatron_ul.checkpoint.training.save import save_checkpoint

    save_checkpoint(trainer.cfg, trainer.model, trainer.optimizer, trainer.scheduler, 2)
    left = sorted(n for n in os.listdir(saved) if n != files.LOCK)
    assert left == ["iter_0000002", files.TRACKER]  # no tmp/old left
    assert listing(saved).keys() == old.keys()


def test_kill_between_renames_loads_the_copy_set_aside(saved):
    """A save replacing iteration 2 killed after moving the old copy aside and before moving
    the new one in leaves only iter_0000002.old-<id>: the tracker still names 2, and it loads."""
    os.rename(os.path.join(saved, "iter_0000002"), os.path.join(saved, "iter_0000002.old-ab12"))
    assert setup(configure(ARGV + ["--load", saved], 1)).start_iteration == 2


@pytest.mark.parametrize(
    "tp, sp, named", [(8, 1, "--tensor-model-parallel-size"), (4, 2, "--ds-sequence-parallel-size")]
)
def test_conversion_target_is_validated_by_the_trainer_before_writing(
    saved, tmp_path, tp, sp, named
):
    """4 heads: TP8, or TP4 × SP2, would be refused at start-up; convert refuses them first."""
    target = str(tmp_path / "out")
    with pytest.raises(files.CheckpointError, match="would be refused by the trainer") as info:
        convert(saved, target, tp, 1, sp=sp)
    assert named in str(info.value) and not os.path.exists(target)


def test_failed_conversion_leaves_no_temporary(saved, tmp_path, monkeypatch):
    target = str(tmp_path / "out")
    real, calls = files.save_torch, []

    def disk_full_on_second_file(obj, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", path)
        real(obj, path)

    monkeypatch.setattr(files, "save_torch", disk_full_on_second_file)
    with pytest.raises(OSError):
        convert(saved, target, 2, 1)
    assert os.listdir(target) == []
