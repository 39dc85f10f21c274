"""Gradient reduction over DP×SP and clipping on one global norm.

Parameters are replicated over data- and sequence-parallel ranks, so their gradients are
*summed* over the dp_sp group: the loss each rank backpropagates is already divided by the
number of tokens in the whole global batch (see training/step.py), so the sum is the gradient
of the global token-mean loss, whatever the layout.
"""
from __future__ import annotations

import math
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..mpu.parallel_state import ParallelDims
from ..mpu.comm_stats import record

_BUCKET_BYTES = 64 * 2**20


def _all_reduce_coalesced(grads: list[torch.Tensor], group) -> None:
    """Sum `grads` over `group` in a few large flat buffers (one per dtype and bucket)."""
    if dist.get_world_size(group) == 1 or not grads:
        return
    buckets: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for g in grads:
        per_dtype = buckets.setdefault(g.dtype, [[]])
        if sum(t.numel() * t.element_size() for t in per_dtype[-1]) > _BUCKET_BYTES:
            per_dtype.append([])
        per_dtype[-1].append(g)
    for per_dtype in buckets.values():
        for bucket in per_dtype:
            flat = _flatten_dense_tensors(bucket)
            record("all_reduce", flat, group)
            dist.all_reduce(flat, group=group)
            for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                g.copy_(reduced)


def reduce_gradients(params: list[torch.nn.Parameter],
                     dims: ParallelDims) -> None:
    """Finish the backward pass: Megatron-SP replicated weights over TP, everything over dp_sp
    (the groups of `dims`)."""
    with_grad = [p for p in params if p.grad is not None]
    sequence_parallel = [p.grad for p in with_grad if getattr(p, "sequence_parallel", False)]
    _all_reduce_coalesced(sequence_parallel, dims.tp_group)
    _all_reduce_coalesced([p.grad for p in with_grad], dims.dp_sp_group)


def _counts_once(p: torch.nn.Parameter, dims: ParallelDims) -> bool:
    """Is this rank the one that counts p in the global norm (no double counting of copies)?"""
    if getattr(p, "shared_embedding_replica", False):  # tied output copy on the last PP stage
        return False
    if getattr(p, "tensor_model_parallel", False):
        return True
    return dims.tp_rank == 0


def global_grad_norm(params: list[torch.nn.Parameter],
                     dims: ParallelDims) -> float:
    """L2 norm of the whole model's gradient, over the model-parallel (TP×PP) group."""
    grads = [p.grad for p in params if p.grad is not None and _counts_once(p, dims)]
    # the parameters' device even when this rank counts no gradient (the reduction needs it)
    sq = torch.zeros((), dtype=torch.float64, device=params[0].device)
    for g in grads:
        sq += g.detach().double().pow(2).sum()
    group = dims.mp_group
    if dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return math.sqrt(sq.item())


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float,
                   dims: ParallelDims) -> float:
    """Scale all gradients so that their global norm is at most max_norm; returns the norm
    before clipping (what Megatron logs as grad-norm)."""
    norm = global_grad_norm(params, dims)
    if max_norm > 0 and math.isfinite(norm):
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coeff)
    return norm
