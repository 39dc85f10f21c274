"""A one-rank gloo process group in the test process, for checkpoint tests that need no peers."""

import shutil

import pytest
import torch.distributed as dist

from megatron_ul.checkpoint import files
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


@pytest.fixture(scope="session")
def pristine(tmp_path_factory):
    """One two-iteration checkpoint of each format, made once: {format: directory}. Copy it
    (see `copy_of`) before changing anything."""
    root = tmp_path_factory.mktemp("pristine")
    # Restored afterwards, not left set: every later subprocess would inherit this one port.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MASTER_ADDR", "127.0.0.1")
        env.setenv("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            model_parallel_seed(0, ps.initialize_model_parallel(1, 1, 1))
            out = {}
            for fmt in ("torch", "torch_dist"):
                out[fmt] = str(root / fmt)
                setup(
                    configure(TINY_TWO_ITERS + ["--save", out[fmt], "--ckpt-format", fmt], 1)
                ).train()
                files.release_save_dir(out[fmt])
        finally:
            dist.destroy_process_group()
    return out


def copy_of(pristine: dict, fmt: str, target) -> str:
    shutil.copytree(pristine[fmt], str(target))
    return str(target)
