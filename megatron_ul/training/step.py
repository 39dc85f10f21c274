"""One optimizer step over a global batch: forward/backward, gradient reduction, clipping,
update. Returns the global token-mean loss and the grad norm, identical on every rank."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..model.chunks import model_chunks, model_dims
from ..model.moe.layer import set_aux_loss_scale
from ..mpu.parallel_state import ParallelDims
from ..optim.contract import TrainingOptimizer
from ..pipeline.schedules import get_forward_backward_func
from ..timers import NO_TIMERS, Timers


def count_tokens(micro_batches: list[dict], device, dims: ParallelDims) -> torch.Tensor:
    """Loss-bearing tokens in the whole global batch (summed over DP and SP ranks), exactly:
    an fp64 tensor on `device` (integers up to 2^53; fp32 was inexact above 2^24 tokens)."""
    # Summed on the device (no host sync per micro-batch) and all-reduced in fp64.
    local = torch.stack([mb["loss_mask"].sum(dtype=torch.float64) for mb in micro_batches]).sum()
    total = local.to(device=device, dtype=torch.float64)
    group = dims.dp_cp_sp_group
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.clamp_min(1.0)


def global_mean_loss(
    local_loss_sum: torch.Tensor, num_tokens: torch.Tensor, dims: ParallelDims
) -> float:
    group = dims.dp_cp_sp_group
    if dist.get_world_size(group) > 1:
        local_loss_sum = local_loss_sum.clone()
        dist.all_reduce(local_loss_sum, group=group)
    if dims.pp > 1:
        # Only the last stage has the loss: every rank reports the same value.
        local_loss_sum = local_loss_sum.clone()
        dist.broadcast(local_loss_sum, dims.group_ranks.pp[-1], group=dims.pp_group)
    return float(local_loss_sum / num_tokens)


def schedule_for(model):
    return get_forward_backward_func(model_dims(model).pp, len(model_chunks(model)))


def train_step(
    model,
    optimizer: TrainingOptimizer,
    micro_batches: list[dict],
    *,
    clip_grad: float,
    iteration: int = 0,
    grad_scaler=None,
    timers: Timers = NO_TIMERS,
) -> tuple[float, float]:
    device = next(p for p in model.parameters() if p.requires_grad).device
    # The exact count, rounded once to the fp32 the losses are divided by (the same value on
    # every rank and layout).
    dims = model_dims(model)
    num_tokens = count_tokens(micro_batches, device, dims).float()
    # fp16: backpropagate loss · scale; dividing the token count by a power of two is exact.
    divisor = num_tokens / grad_scaler.scale if grad_scaler is not None else num_tokens
    # Gradients are reduced in buckets, from backward's hooks when overlapping (ZeRO-2: every
    # micro-batch).
    optimizer.start_step(len(micro_batches))
    # MoE aux losses count as their mean over the global batch's micro-batches (Megatron's).
    scale = grad_scaler.scale if grad_scaler is not None else 1.0
    set_aux_loss_scale(model, scale / (len(micro_batches) * dims.dp))
    loss_sum = schedule_for(model)(model, micro_batches, divisor, timers=timers)
    loss = global_mean_loss(loss_sum, num_tokens, dims)
    if not math.isfinite(loss):
        # Megatron's --check-for-nan-in-loss-and-grad: stop rather than train on garbage.
        raise FloatingPointError(
            f"iteration {iteration}: loss is {loss}; stopping. Lower --lr, "
            f"raise --clip-grad's strictness or check the data"
        )
    if grad_scaler is not None and not grad_scaler.unscale_and_check(
        optimizer.local_grads(), device, iteration
    ):
        optimizer.reduce_and_clip(0.0)  # fp16 overflow: finish the reduction, skip the step
        optimizer.zero_grad()
        return loss, float("nan")
    with timers("grad-reduce"):
        # Tied embedding copies (first and last pipeline stage) sum their gradients inside.
        grad_norm = optimizer.reduce_and_clip(clip_grad)
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"iteration {iteration}: grad norm is {grad_norm}; stopping")
    with timers("optimizer"):
        optimizer.step()
    optimizer.zero_grad()
    return loss, grad_norm


@torch.no_grad()
def evaluate_loss(model, micro_batches: list[dict]) -> float:
    device = next(model.parameters()).device
    dims = model_dims(model)
    num_tokens = count_tokens(micro_batches, device, dims).float()
    model.eval()
    try:
        loss_sum = schedule_for(model)(model, micro_batches, num_tokens, forward_only=True)
    finally:
        model.train()
    return global_mean_loss(loss_sum, num_tokens, dims)
