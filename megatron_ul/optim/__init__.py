"""Optimizer construction: AdamW with Megatron's weight-decay groups."""
from __future__ import annotations

import logging

import torch

from ..config import TrainConfig

log = logging.getLogger(__name__)


def build_optimizer(model: torch.nn.Module, train: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; biases and norm weights (1-D parameters) get no weight decay, as in Megatron."""
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
