"""A one-rank gloo process group in the test process, for checkpoint tests that need no peers."""

import pytest
import torch.distributed as dist

from megatron_ul.mpu import parallel_state as ps
from megatron_ul.mpu.random import model_parallel_seed
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.runs import TINY_TWO_ITERS
from tests.distributed import free_port


@pytest.fixture
def single_rank(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", rank=0, world_size=1)
    dims = ps.initialize_model_parallel(1, 1, 1)
    model_parallel_seed(0, dims)
    yield dims
    dist.destroy_process_group()


@pytest.fixture
def saved(tmp_path, single_rank):
    """A checkpoint of the tiny model after two iterations (one rank): its directory."""
    d = str(tmp_path / "ckpt")
    setup(configure(TINY_TWO_ITERS + ["--save", d], 1)).train()
    return d
