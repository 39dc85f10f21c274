"""torch.distributed from torchrun or Slurm environment variables, the rank grid, and seeds."""

from __future__ import annotations

import datetime
import logging
import os
import socket

import torch
import torch.distributed as dist

from .config import Config
from .mpu import parallel_state as ps
from .mpu.parallel_state import ParallelDims
from .mpu.random import model_parallel_seed

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on loopback that is free right now (for single-node rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun, else Slurm (srun without torchrun), else 1."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "MASTER_ADDR" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return 0, 1, 0


def world_size_from_env() -> int:
    return _rank_env()[1]


def _one_process_rendezvous(world: int) -> str | None:
    """Where a plain `python pretrain_gpt.py` (one process, no launcher) meets itself: loopback
    on a free port unless MASTER_ADDR / MASTER_PORT say otherwise. Passed as the init method,
    not written into os.environ, where every later subprocess of this process would inherit a
    port that is already taken."""
    if world != 1:
        return None  # the launcher's env:// rendezvous
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT") or str(free_port())
    return f"tcp://{addr}:{port}"


def initialize_distributed(cfg: Config) -> tuple[torch.device, ParallelDims]:
    """Start the process group (if needed), build every parallel group, seed the RNGs.

    Returns the device this rank computes on and the rank grid, which the caller hands to
    everything that communicates (the one ParallelDims of the run).
    """
    rank, world, local_rank = _rank_env()
    timeout = datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    dist_backend = cfg.parallel.distributed_backend or (
        "nccl" if torch.cuda.is_available() else "gloo"
    )
    if dist_backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("--distributed-backend nccl needs GPUs; use gloo on CPU")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # device_id binds this rank's GPU to the group, so barriers and object collectives
        # (checkpoint saves) use it instead of guessing; CPU/gloo has nothing to bind.
        dist.init_process_group(
            dist_backend,
            init_method=_one_process_rendezvous(world),
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    p = cfg.parallel
    dims = ps.initialize_model_parallel(
        p.tensor_model_parallel_size,
        p.ds_sequence_parallel_size,
        p.pipeline_model_parallel_size,
        timeout=timeout,
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
    )
    model_parallel_seed(cfg.train.seed, dims, device.type)
    if rank == 0:
        log.info(
            "world %d = PP %d × DP %d × CP %d × SP %d × TP %d on %s (%s)",
            world,
            p.pipeline_model_parallel_size,
            p.data_parallel_size,
            p.context_parallel_size,
            p.ds_sequence_parallel_size,
            p.tensor_model_parallel_size,
            device,
            dist_backend,
        )
    return device, dims


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
