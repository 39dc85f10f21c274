"""Collect full parameters from ZeRO runs for the layout-equivalence comparison."""
from __future__ import annotations

from torch.distributed.tensor import DTensor

from megatron_ul.mpu import parallel_state as ps
from megatron_ul.pipeline.model import global_named_parameters
from megatron_ul.training.pretrain import configure, setup
from tests.distributed import run_distributed
from tests.training.equivalence import merge_tp_shards


def train_and_collect_full(rank: int, world: int, argv: list[str]) -> dict:
    """Like equivalence.train_and_collect, but gathers FSDP2's DTensor shards (a collective
    over dp_sp, so every rank takes part) before the DP0/SP0 ranks keep them."""
    trainer = setup(configure(argv, world))
    losses = trainer.train()
    shards = {}
    # Global names (layer numbers, not per-stage indices), so pipeline stages merge.
    for name, p in global_named_parameters(trainer.model):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        shards[name] = (full.detach().clone(), getattr(p, "partition_dim", None),
                        getattr(p, "partition_stride", 1))
    if ps.get_data_parallel_rank() != 0 or ps.get_sequence_parallel_rank() != 0:
        shards = {}
    return {"losses": losses, "tp_rank": ps.get_tensor_model_parallel_rank(), "shards": shards,
            "optimizer_state": _optimizer_state_bytes(trainer.optimizer)}


def _optimizer_state_bytes(optimizer) -> int:
    state = optimizer.state_dict()
    inner = state["optimizer"]["state"] if "optimizer" in state and "format" in state \
        else state["state"]
    total = 0
    for per_param in inner.values():
        for value in per_param.values():
            if hasattr(value, "numel") and value.dim() > 0:
                local = value.to_local() if isinstance(value, DTensor) else value
                total += local.numel() * local.element_size()
    return total


def run_zero_layout(argv: list[str], world: int):
    """(losses, full params, per-rank optimizer-state bytes)."""
    results = run_distributed(train_and_collect_full, world, argv)
    losses = results[0]["losses"]
    for r in results:
        assert r["losses"] == losses
    return losses, merge_tp_shards(results), [r["optimizer_state"] for r in results]
