"""Optimizer construction: AdamW with Megatron's weight-decay groups, one kind per layout
(contract.py says what every kind offers)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..model.chunks import tied_embedding_weights
from ..mpu.parallel_state import ParallelDims
from .contract import TrainingOptimizer
from .grad_buckets import bucket_elements
from .mixed_precision import MainParamOptimizer
from .replicated import ReplicatedOptimizer

log = logging.getLogger(__name__)

__all__ = ["TrainingOptimizer", "build_optimizer"]


def build_optimizer(
    model: torch.nn.Module, train: TrainConfig, parallel, dims: ParallelDims
) -> TrainingOptimizer:
    """AdamW; biases and norm weights (1-D parameters) get no weight decay, as in Megatron.
    parallel.zero_stage (0-3; `parallel` None: no ZeRO) picks the kind; every kind reduces
    its gradients (in buckets, overlapped with backward on request) over the groups of
    `dims`; weights tied across pipeline stages are first summed over the embedding group."""
    stage = parallel.zero_stage if parallel is not None else 0
    overlap = bool(parallel is not None and parallel.overlap_grad_reduce)
    dp_cp_sp = dist.get_world_size(dims.dp_cp_sp_group)
    elements = bucket_elements(parallel.ddp_bucket_size if parallel is not None else None, dp_cp_sp)
    tied = tied_embedding_weights(model) if dims.pp > 1 else []
    offload = train.optimizer_offload_fraction if train.optimizer_cpu_offload else 0.0
    if stage in (1, 2):
        from .distributed_optimizer import DistributedOptimizer
        from .zero2 import Zero2Optimizer

        log.info(
            "optimizer: ZeRO-%d distributed AdamW over dp_cp_sp (gradient reduce-scatter %s, "
            "parameter all-gather %s)",
            stage,
            ("per micro-batch, " if stage == 2 else "")
            + ("overlapped" if overlap else "after backward"),
            "overlapped" if parallel.overlap_param_gather else "after the step",
        )
        kind = Zero2Optimizer if stage == 2 else DistributedOptimizer
        return kind(
            model,
            train,
            dims,
            max_bucket_elements=elements,
            overlap_grad_reduce=overlap,
            overlap_param_gather=parallel.overlap_param_gather,
            tied=tied,
            offload_fraction=offload,
        )
    if stage == 3:
        from .zero3 import Zero3Optimizer

        log.info("optimizer: ZeRO-3 (FSDP2 over dp_cp_sp), torch AdamW on the shards")
        return Zero3Optimizer(model, train, dims, tied=tied)
    params = [p for p in model.parameters() if p.requires_grad]
    on_gpu = any(p.is_cuda for p in model.parameters())
    half = any(p.dtype != torch.float32 for p in params)
    log.info(
        "optimizer: torch AdamW (%s)%s; gradient all-reduce over dp_cp_sp %s",
        "fused CUDA kernel" if on_gpu and not offload else "foreach",
        " on fp32 main copies" if half else "",
        "overlapped with backward" if overlap else "after backward",
    )
    if half or offload:
        return MainParamOptimizer(
            model,
            train,
            dims,
            max_bucket_elements=elements,
            overlap_grad_reduce=overlap,
            tied=tied,
            fused=on_gpu,
            offload_fraction=offload,
        )
    return ReplicatedOptimizer(
        model,
        train,
        dims,
        max_bucket_elements=elements,
        overlap_grad_reduce=overlap,
        tied=tied,
        fused=on_gpu,
    )
