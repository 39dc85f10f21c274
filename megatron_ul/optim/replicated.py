"""Replicated data parallelism: every rank holds the whole optimizer state; torch AdamW steps
the parameters themselves (an fp32 model that offloads nothing). Gradients are summed over
their reduction groups in buckets (grads.DataParallelGradSync), after backward or overlapped
with it, then clipped on one global norm."""

from __future__ import annotations

import torch

from ..config import TrainConfig
from ..mpu.parallel_state import ParallelDims
from .contract import ParamStates, TrainingOptimizer
from .grads import DataParallelGradSync, clip_gradients


def adamw(groups: list[dict], train: TrainConfig, **kwargs) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        groups,
        lr=train.lr,
        betas=(train.adam_beta1, train.adam_beta2),
        eps=train.adam_eps,
        **kwargs,
    )


def weight_decay_groups(params: list, train: TrainConfig, is_1d=None) -> list[dict]:
    """Megatron's groups: biases and norm weights (1-D parameters) take no weight decay.
    `is_1d(t)` decides for a tensor that stands for a parameter (a ZeRO piece)."""
    is_1d = is_1d or (lambda t: t.dim() == 1)
    return [
        {"params": [t for t in params if not is_1d(t)], "weight_decay": train.weight_decay},
        {"params": [t for t in params if is_1d(t)], "weight_decay": 0.0},
    ]


class ReplicatedOptimizer(TrainingOptimizer):
    def __init__(
        self,
        model: torch.nn.Module,
        train: TrainConfig,
        dims: ParallelDims,
        *,
        max_bucket_elements: int,
        overlap_grad_reduce: bool = False,
        tied=(),
        fused: bool = False,
    ):
        self.dims, self.states, self.tied = dims, ParamStates(), list(tied)
        self.params = [p for p in model.parameters() if p.requires_grad]
        groups = weight_decay_groups(self.params, train)
        # Before the reduction's gradient hooks: main-gradient accumulation hooks run first.
        self.optimizer = self._build_inner(model, train, groups, fused)
        self.grad_sync = DataParallelGradSync(
            self.params,
            max_bucket_elements,
            dims,
            self.grad,
            overlap=overlap_grad_reduce,
            deferred_params=self.tied,
        )

    def _build_inner(self, model, train: TrainConfig, groups: list[dict], fused: bool):
        del model
        return adamw(groups, train, **({"fused": True} if fused else {"foreach": True}))

    def start_step(self, num_micro_batches: int) -> None:
        self.grad_sync.start(num_micro_batches)

    def reduce_and_clip(self, max_norm: float) -> float:
        self.grad_sync.finish()
        # After the dp_cp_sp reduction, so both copies end bitwise equal (a + b == b + a):
        # before it, each stage's copy would be reduced inside differently laid-out buckets,
        # and with 3+ dp_cp_sp ranks the summation orders (and roundings) differ.
        self.sum_tied_grads()
        return clip_gradients(self.params, max_norm, self.dims, self.grad)

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
