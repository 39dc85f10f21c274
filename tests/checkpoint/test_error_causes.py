"""Errors keep their cause and reach every rank: DCP's root cause (disk full) and a missing
rank file's name are in the message; an error on one rank is raised, naming that rank, on
rank 0 too; tools/generate.py reads a torch_dist checkpoint's own saved arguments."""

import errno
import os

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.training.save import save_checkpoint
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.conftest import copy_of
from tests.checkpoint.runs import TINY_TWO_ITERS as ARGV
from tests.checkpoint.runs import load_error, train
from tests.distributed import run_distributed


def test_a_full_disk_under_dcp_is_named(pristine, tmp_path, single_rank, monkeypatch):
    save = copy_of(pristine, "torch_dist", tmp_path / "ckpt")
    trainer = setup(
        configure(ARGV + ["--load", save, "--save", save, "--ckpt-format", "torch_dist"], 1)
    )
    long_name = os.path.join(save, "x" * 300, "__0_0.distcp")  # a long path before the cause

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device", long_name)

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    with pytest.raises(files.CheckpointError) as info:
        save_checkpoint(trainer.cfg, trainer.model, trainer.optimizer, trainer.scheduler, 3)
    message = str(info.value)
    assert "No space left on device" in message and long_name in message
    assert "iter_0000003.tmp-" in message and files.read_tracker(save) == 2


def test_generate_reads_a_torch_dist_checkpoints_arguments(pristine, tmp_path, capsys):
    from tools import generate

    save = copy_of(pristine, "torch_dist", tmp_path / "ckpt")
    try:
        assert generate.main(["--load", save, "--prompt", "1 2", "--max-new-tokens", "2"]) == 0
    finally:  # the tool sets up a one-process group for itself; later tests make their own
        if dist.is_initialized():
            dist.destroy_process_group()
    assert capsys.readouterr().out.startswith("1 2 ")


def one_rank_fails(rank: int, world: int, argv: list[str], save: str, victim: str) -> str:
    """Save with every rank, damage `victim` of iteration 2, load with every rank: each
    rank's error message."""
    train(rank, world, argv + ["--save", save])
    dist.barrier()
    if rank == 0:
        path = os.path.join(save, "iter_0000002", victim)
        if victim.endswith(".distcp"):
            os.remove(path)
        else:
            data = bytearray(open(path, "rb").read())
            data[len(data) // 2] ^= 1
            open(path, "wb").write(bytes(data))
    dist.barrier()
    return load_error(rank, world, argv + ["--load", save])


@pytest.mark.parametrize(
    "fmt,victim,named",
    [
        ("torch", "rng/rank_00001.pt", "rank 1: "),
        ("torch_dist", "__1_0.distcp", "missing (stored pieces"),
    ],
)
def test_one_ranks_error_reaches_rank_0_with_its_cause(tmp_path, fmt, victim, named):
    save = str(tmp_path / "ckpt")
    messages = run_distributed(one_rank_fails, 2, ARGV + ["--ckpt-format", fmt], save, victim)
    path = os.path.join(save, "iter_0000002", victim)
    for rank, message in enumerate(messages):
        assert message.startswith("CheckpointError: "), (rank, message)
        assert path in message and named in message, (rank, message)
