"""ZeRO-1 over the DP×SP group (--use-distributed-optimizer): Adam state and the fp32 master
weights are sharded over dp_sp; every rank keeps full parameters and full gradients.

Layout. All trainable parameters are packed, in model.parameters() order, into one contiguous
fp32 buffer padded to a multiple of N = dp_sp size; the model's parameters become views of
it. Rank r owns elements [r·S, (r+1)·S) with S = padded / N. Parameters stay fp32 (--bf16 and
--fp16 compute under autocast), so the owned slice of this buffer *is* the fp32 master copy of
the shard: no second copy is kept. Gradients are views of a twin buffer, so autograd
accumulates straight into it.

Step. (1) Megatron-SP replicated weights: all-reduce over TP, as in grads.py. (2) Reduce-
scatter the gradient buffer over dp_sp with SUM (the loss is already divided by the global
token count, see training/step.py), in place: the owned slice receives the sum, the rest of
the buffer is stale until zero_grad. (3) Global norm from the local shard: sum of squares of
the owned elements, all-reduced over dp_sp, then over the model-parallel group; TP-replicated
parameters count only on TP rank 0 (grads._counts_once). (4) Clip the shard. (5) torch AdamW
steps views of the owned slice, one view per (parameter ∩ shard), in Megatron's weight-decay
groups (no decay for 1-D parameters) — element for element the same arithmetic as the
unsharded optimizer. (6) All-gather the parameter buffer (in place).

Checkpoint format (state_dict(), one per dp_sp rank; load on the same layout):
    {"format": "megatron_ul.zero1.v1",
     "dp_sp_rank": r, "dp_sp_size": N, "numel": total elements, "padded_numel": N·S,
     "shard": (start, end) — this rank's elements of the flat buffer,
     "pieces": [(param name, param offset in buffer, piece start, piece end)] in the inner
               optimizer's parameter order (start/end are flat-buffer indices),
     "optimizer": torch AdamW state_dict over those pieces (exp_avg, exp_avg_sq, step)}
The master weights are the model parameters: save them with the model as usual.
Training checkpoints do not use this per-rank format: checkpoint/zero.py gathers the moments
into the per-parameter form plain AdamW checkpoints use, so they load on any layout.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..mpu.parallel_state import ParallelDims
from ..mpu.comm_stats import record
from .grads import _all_reduce_coalesced, _counts_once

FORMAT = "megatron_ul.zero1.v1"


class DistributedOptimizer:
    """Drop-in for the torch optimizer in train_step; owns gradient reduction and clipping."""

    def __init__(self, model: torch.nn.Module, train: TrainConfig,
                 dims: ParallelDims):
        self.dims = dims
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if len({p.dtype for _, p in named}) != 1 or named[0][1].dtype != torch.float32:
            raise ValueError("the distributed optimizer expects fp32 parameters "
                             "(mixed precision runs under autocast)")
        self.params = [p for _, p in named]
        self.group = self.dims.dp_sp_group
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        device = self.params[0].device
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = math.ceil(self.numel / self.size)
        padded = self.shard_numel * self.size
        self.start, self.end = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        self.param_buffer = torch.zeros(padded, dtype=torch.float32, device=device)
        self.grad_buffer = torch.zeros(padded, dtype=torch.float32, device=device)
        # Reduce-scatter and all-gather run in place on these slices (as Megatron does):
        # no extra shard-sized buffers.
        self.grad_shard = self.grad_buffer[self.start:self.end]
        self.pieces = self._bind_params(named)
        self.optimizer = self._build_inner(train)

    def _bind_params(self, named) -> list[tuple]:
        """Make params/grads views of the buffers; return the pieces this rank owns."""
        pieces, offset = [], 0
        for name, p in named:
            n = p.numel()
            view = self.param_buffer[offset:offset + n].view_as(p)
            view.copy_(p.detach())
            p.data = view
            p.grad = self.grad_buffer[offset:offset + n].view_as(p)
            lo, hi = max(offset, self.start), min(offset + n, self.end)
            if lo < hi:
                pieces.append((name, p, offset, lo, hi))
            offset += n
        return pieces

    def _build_inner(self, train: TrainConfig) -> torch.optim.AdamW:
        decay, no_decay = [], []
        for _, p, _, lo, hi in self.pieces:
            piece = self.param_buffer[lo:hi]
            piece.grad = self.grad_shard[lo - self.start:hi - self.start]
            (no_decay if p.dim() == 1 else decay).append(piece)
        groups = [{"params": decay, "weight_decay": train.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2),
                                 eps=train.adam_eps, foreach=True)

    # ---- what train_step and the LR schedule use ------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def reduce_and_clip_gradients(self, max_norm: float) -> float:
        """Steps (1)-(4) of the module docstring; returns the norm before clipping."""
        sequence_parallel = [p.grad for p in self.params if getattr(p, "sequence_parallel", False)]
        _all_reduce_coalesced(sequence_parallel, self.dims.tp_group)
        if self.size > 1:
            record("reduce_scatter", self.grad_buffer, self.group)
            dist.reduce_scatter_tensor(self.grad_shard, self.grad_buffer, group=self.group)
        norm = self._global_norm()
        if max_norm > 0 and math.isfinite(norm):
            coeff = max_norm / (norm + 1e-6)
            if coeff < 1.0:
                self.grad_shard.mul_(coeff)
        return norm

    def _global_norm(self) -> float:
        sq = torch.zeros((), dtype=torch.float64, device=self.grad_shard.device)
        for _, p, _, lo, hi in self.pieces:
            if _counts_once(p, self.dims):
                sq += self.grad_shard[lo - self.start:hi - self.start].double().pow(2).sum()
        for group in (self.group, self.dims.mp_group):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(sq, group=group)
        return math.sqrt(sq.item())

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        if self.size > 1:
            record("all_gather", self.param_buffer, self.group)
            dist.all_gather_into_tensor(self.param_buffer, self.param_buffer[self.start:self.end],
                                        group=self.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero in place: the parameters' .grad must stay views of the gradient buffer."""
        del set_to_none
        self.grad_buffer.zero_()

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"format": FORMAT, "dp_sp_rank": self.rank, "dp_sp_size": self.size,
                "numel": self.numel, "padded_numel": self.param_buffer.numel(),
                "shard": (self.start, self.end),
                "pieces": [(name, offset, lo, hi) for name, _, offset, lo, hi in self.pieces],
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("format", "dp_sp_rank", "dp_sp_size", "numel", "shard", "pieces"):
            if state.get(key) != mine[key]:
                raise ValueError(f"distributed-optimizer checkpoint does not match this run "
                                 f"({key}: saved {state.get(key)!r}, now {mine[key]!r}); load it "
                                 f"with the same model and the same DP×SP size")
        self.optimizer.load_state_dict(state["optimizer"])
