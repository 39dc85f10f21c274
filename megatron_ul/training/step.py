"""One optimizer step over a global batch: forward/backward, gradient reduction, clipping,
update. Returns the global token-mean loss and the grad norm, identical on every rank."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..mpu import parallel_state as ps
from ..optim.grads import clip_gradients, reduce_gradients
from ..pipeline.schedules import forward_backward_no_pipelining
from .timers import timer


def count_tokens(micro_batches: list[dict], device) -> torch.Tensor:
    """Loss-bearing tokens in the whole global batch (summed over DP and SP ranks)."""
    local = sum(float(mb["loss_mask"].sum()) for mb in micro_batches)
    total = torch.tensor(local, dtype=torch.float32, device=device)
    group = ps.get_data_sequence_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.clamp_min(1.0)


def global_mean_loss(local_loss_sum: torch.Tensor, num_tokens: torch.Tensor) -> float:
    group = ps.get_data_sequence_parallel_group()
    if dist.get_world_size(group) > 1:
        local_loss_sum = local_loss_sum.clone()
        dist.all_reduce(local_loss_sum, group=group)
    return float(local_loss_sum / num_tokens)


def train_step(model, optimizer, micro_batches: list[dict], *, clip_grad: float,
               autocast_dtype=None, iteration: int = 0) -> tuple[float, float]:
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    num_tokens = count_tokens(micro_batches, device)
    loss_sum = forward_backward_no_pipelining(model, micro_batches, num_tokens, autocast_dtype)
    loss = global_mean_loss(loss_sum, num_tokens)
    if not math.isfinite(loss):
        # Megatron's --check-for-nan-in-loss-and-grad: stop rather than train on garbage.
        raise FloatingPointError(f"iteration {iteration}: loss is {loss}; stopping. Lower --lr, "
                                 f"raise --clip-grad's strictness or check the data")
    with timer("grad-reduce"):
        reduce_gradients(params)
    with timer("grad-clip", level=2):
        grad_norm = clip_gradients(params, clip_grad)
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"iteration {iteration}: grad norm is {grad_norm}; stopping")
    with timer("optimizer"):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


@torch.no_grad()
def evaluate_loss(model, micro_batches: list[dict], autocast_dtype=None) -> float:
    device = next(model.parameters()).device
    num_tokens = count_tokens(micro_batches, device)
    model.eval()
    try:
        loss_sum = forward_backward_no_pipelining(model, micro_batches, num_tokens, autocast_dtype,
                                                  forward_only=True)
    finally:
        model.train()
    return global_mean_loss(loss_sum, num_tokens)
