"""Optimizer construction: AdamW with Megatron's weight-decay groups."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..model.chunks import tied_embedding_weights
from ..mpu.parallel_state import ParallelDims
from .grad_buckets import bucket_elements
from .grads import DataParallelGradSync
from .mixed_precision import MainParamOptimizer

log = logging.getLogger(__name__)


def build_optimizer(model: torch.nn.Module, train: TrainConfig, parallel, dims: ParallelDims):
    """AdamW; biases and norm weights (1-D parameters) get no weight decay, as in Megatron.
    With ZeRO (parallel.zero_stage 1 or 3; `parallel` None: no ZeRO) the optimizer also owns
    gradient reduction; without, `optimizer.grad_sync` does it (in buckets, overlapped with
    backward on request). Either reduces over the groups of `dims` (the run's ParallelDims)."""
    stage = parallel.zero_stage if parallel is not None else 0
    overlap = bool(parallel is not None and parallel.overlap_grad_reduce)
    dp_cp_sp = dist.get_world_size(dims.dp_cp_sp_group)
    elements = bucket_elements(parallel.ddp_bucket_size if parallel is not None else None, dp_cp_sp)
    # Weights tied across pipeline stages are summed over the embedding group first.
    tied = tied_embedding_weights(model) if dims.pp > 1 else []
    offload = train.optimizer_offload_fraction if train.optimizer_cpu_offload else 0.0
    if stage == 1:
        from .distributed_optimizer import DistributedOptimizer

        log.info(
            "optimizer: ZeRO-1 distributed AdamW over dp_cp_sp (gradient reduce-scatter %s, "
            "parameter all-gather %s)",
            "overlapped" if overlap else "after backward",
            "overlapped" if parallel.overlap_param_gather else "after the step",
        )
        return DistributedOptimizer(
            model,
            train,
            dims,
            max_bucket_elements=elements,
            overlap_grad_reduce=overlap,
            overlap_param_gather=parallel.overlap_param_gather,
            deferred_params=tied,
            offload_fraction=offload,
        )
    if stage == 3:
        from .zero3 import Zero3Optimizer

        log.info("optimizer: ZeRO-3 (FSDP2 over dp_cp_sp), torch AdamW on the shards")
        return Zero3Optimizer(model, train, dims)
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.dim() == 1 else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    on_gpu = any(p.is_cuda for p in model.parameters())
    half = any(p.dtype != torch.float32 for p in decay + no_decay)
    log.info(
        "optimizer: torch AdamW (%s)%s; gradient all-reduce over dp_cp_sp %s",
        "fused CUDA kernel" if on_gpu and not offload else "foreach",
        " on fp32 main copies" if half else "",
        "overlapped with backward" if overlap else "after backward",
    )
    optimizer: MainParamOptimizer | torch.optim.AdamW
    if half or offload:
        # Before the gradient hooks of the reduction: the fp32 accumulation hooks run first.
        optimizer = MainParamOptimizer(model, train, groups, offload_fraction=offload, fused=on_gpu)
    else:
        kwargs = {"fused": True} if on_gpu else {"foreach": True}
        optimizer = torch.optim.AdamW(
            groups,
            lr=train.lr,
            betas=(train.adam_beta1, train.adam_beta2),
            eps=train.adam_eps,
            **kwargs,
        )
    optimizer.grad_sync = DataParallelGradSync(  # type: ignore[union-attr]
        [p for p in model.parameters() if p.requires_grad],
        elements,
        dims,
        overlap=overlap,
        deferred_params=tied,
    )
    return optimizer
