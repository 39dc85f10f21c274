"""Integrity: every file's SHA-256 is checked on load (a flipped byte is named, not loaded);
one job per save directory (a POSIX lock the kernel releases on kill -9); disk-full errors name
the path and leave the previous checkpoint current; opt-in retention and removal of what killed
saves left; a complete copy set aside is preferred to one whose deletion was interrupted."""

import os
import shutil
import signal
import subprocess
import sys

import pytest

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.training.save import save_checkpoint
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.runs import TINY, listing
from tests.checkpoint.runs import TINY_TWO_ITERS as ARGV


def _load_error(argv) -> str:
    with pytest.raises(files.CheckpointError) as info:
        setup(configure(argv, 1))
    return str(info.value)


@pytest.mark.parametrize("victim", ["mp_rank_00/model_optim_rng.pt", "rng/rank_00000.pt"])
def test_a_flipped_byte_is_named_and_not_loaded(saved, victim):
    path = os.path.join(saved, "iter_0000002", victim)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01  # inside the tensor data: torch.load alone would not see it
    open(path, "wb").write(bytes(data))
    message = _load_error(ARGV + ["--load", saved])
    assert path in message and "corrupt" in message and "SHA-256" in message


HOLD_LOCK = """
import sys, time
from megatron_ul.checkpoint import files
files.claim_save_dir(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_job_cannot_save_into_the_same_directory(saved):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files.release_save_dir(saved)  # the fixture's run took it
    other = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, saved],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
    )
    try:
        assert other.stdout.readline().strip() == "held"
        message = _load_error(ARGV + ["--save", saved])
        assert f"--save {saved} is in use by pid {other.pid}" in message
    finally:
        other.send_signal(signal.SIGKILL)  # the kernel drops its lock with it
        other.wait()
    files.claim_save_dir(saved)


def test_disk_full_names_the_path_and_keeps_the_previous_checkpoint(saved, monkeypatch):
    trainer = setup(configure(ARGV + ["--save", saved, "--load", saved], 1))
    before = listing(saved)
    calls = []

    def full_disk(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full_disk)
    with pytest.raises(files.CheckpointError) as info:
        save_checkpoint(trainer.cfg, trainer.model, trainer.optimizer, trainer.scheduler, 3)
    monkeypatch.undo()
    message = str(info.value)
    assert "No space left on device" in message and "iter_0000003.tmp-" in message
    assert files.read_tracker(saved) == 2 and listing(saved) == before  # nothing left behind


def test_keep_last_n_and_removal_of_unfinished_saves(tmp_path, single_rank):
    d = str(tmp_path / "ckpt")
    for leftover in ("iter_0000001.tmp-dead", "iter_0000001.old-dead", "iter_0000001.del-dead"):
        os.makedirs(os.path.join(d, leftover, "rng"))
    setup(
        configure(
            TINY
            + [
                "--train-iters",
                "4",
                "--save",
                d,
                "--save-interval",
                "1",
                "--keep-last-n-checkpoints",
                "2",
                "--remove-unfinished-checkpoints",
            ],
            1,
        )
    ).train()
    assert sorted(n for n in os.listdir(d) if n.startswith("iter_")) == [
        "iter_0000003",
        "iter_0000004",
    ]


def test_a_complete_copy_is_preferred_to_a_half_deleted_one(saved):
    """Two kills during cleanup: iteration 2 exists only as copies set aside, one of them
    partly deleted; the loader takes the complete one, whatever their names' order."""
    final = os.path.join(saved, "iter_0000002")
    shutil.copytree(final, final + ".old-ffff")
    os.remove(os.path.join(final + ".old-ffff", "mp_rank_00", files.MODEL_FILE))
    os.rename(final, final + ".old-0000")
    os.utime(final + ".old-0000", (1, 1))  # older too: completeness decides, not age
    assert files.find_iteration_dir(saved, 2) == final + ".old-0000"
    assert setup(configure(ARGV + ["--load", saved], 1)).start_iteration == 2
