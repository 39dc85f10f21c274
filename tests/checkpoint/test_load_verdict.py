"""Rank 0 says "loaded checkpoint" only once every rank's load has succeeded: when another
rank's file is damaged, every rank raises naming it and no rank says it loaded."""

import logging
import os

import pytest
import torch.distributed as dist

from tests.checkpoint.runs import TINY_TWO_ITERS as ARGV
from tests.checkpoint.runs import load_error, train
from tests.distributed import run_distributed


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def rank_1_fails(rank: int, world: int, argv: list[str], save: str, damage: bool):
    """Save, damage rank 1's RNG file (if `damage`), load: (the error, the lines logged)."""
    train(rank, world, argv + ["--save", save])
    dist.barrier()
    if rank == 0 and damage:
        path = os.path.join(save, "iter_0000002", "rng", "rank_00001.pt")
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 1
        open(path, "wb").write(bytes(data))
    dist.barrier()
    lines = _Lines()
    logger = logging.getLogger("megatron_ul")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        error = load_error(rank, world, argv + ["--load", save])
    finally:
        logger.removeHandler(lines)
    return error, lines.lines


@pytest.mark.parametrize("damage", [True, False])
def test_loaded_is_said_only_after_every_rank_loaded(tmp_path, damage):
    save = str(tmp_path / "ckpt")
    results = run_distributed(rank_1_fails, 2, ARGV, save, damage)
    said = [[s for s in lines if s.startswith("loaded checkpoint")] for _, lines in results]
    if damage:
        for rank, (error, _) in enumerate(results):
            assert "rank_00001.pt" in error and "corrupt" in error, (rank, error)
        assert said == [[], []]
    else:
        assert [error for error, _ in results] == ["", ""]
        assert len(said[0]) == 1 and said[1] == []
