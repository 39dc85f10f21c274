"""Forward-backward schedules over the micro-batches of one global batch.

The loss each rank backpropagates is sum(token losses · mask) / (tokens in the whole global
batch, over all DP and SP ranks), so gradients summed over dp_sp give exactly the gradient of
the global token-mean loss, for every layout and every loss mask.
"""
from __future__ import annotations

import contextlib

import torch

from ..training.timers import timer


def micro_batch_loss_sum(model, batch: dict) -> torch.Tensor:
    """Sum over this rank's tokens of the masked per-token loss of one micro-batch."""
    losses = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"])
    return (losses * batch["loss_mask"]).sum()


def forward_backward_no_pipelining(model, micro_batches: list[dict], num_tokens: torch.Tensor,
                                   autocast_dtype=None, forward_only: bool = False
                                   ) -> torch.Tensor:
    """Run every micro-batch forward and backward on this rank; return the detached sum of
    masked token losses (not yet divided by num_tokens)."""
    device_type = num_tokens.device.type
    total = torch.zeros((), dtype=torch.float32, device=num_tokens.device)
    for batch in micro_batches:
        autocast = (torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype
                    else contextlib.nullcontext())
        with timer("forward"), autocast, (torch.no_grad() if forward_only
                                          else contextlib.nullcontext()):
            loss_sum = micro_batch_loss_sum(model, batch)
        if not forward_only:
            with timer("backward"):
                (loss_sum / num_tokens).backward()
        total += loss_sum.detach().float()
    return total
