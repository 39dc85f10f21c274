"""Optimizer construction: AdamW with Megatron's weight-decay groups."""
from __future__ import annotations

import logging

import torch

from ..config import TrainConfig
from ..mpu.parallel_state import ParallelDims

log = logging.getLogger(__name__)


def build_optimizer(model: torch.nn.Module, train: TrainConfig, parallel,
                    dims: ParallelDims):
    """AdamW; biases and norm weights (1-D parameters) get no weight decay, as in Megatron.
    With ZeRO (parallel.zero_stage 1 or 3; `parallel` None: no ZeRO) the optimizer also owns
    gradient reduction, over the groups of `dims` (the run's ParallelDims)."""
    stage = parallel.zero_stage if parallel is not None else 0
    if stage == 1:
        from .distributed_optimizer import DistributedOptimizer
        log.info("optimizer: ZeRO-1 distributed AdamW over dp_sp")
        return DistributedOptimizer(model, train, dims)
    if stage == 3:
        from .zero3 import Zero3Optimizer
        log.info("optimizer: ZeRO-3 (FSDP2 over dp_sp), torch AdamW on the shards")
        return Zero3Optimizer(model, train, dims)
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.dim() == 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": train.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    on_gpu = any(p.is_cuda for p in model.parameters())
    kwargs = {"fused": True} if on_gpu else {"foreach": True}
    log.info("optimizer: torch AdamW (%s)", "fused CUDA kernel" if on_gpu else "foreach, CPU")
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2),
                             eps=train.adam_eps, **kwargs)
