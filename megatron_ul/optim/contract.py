"""What every optimizer kind offers the training step and the checkpoints.

One implementation per kind: replicated data parallelism (`ReplicatedOptimizer`, torch AdamW on
the parameters), fp32 main parameters for a half-precision model or the host step
(`MainParamOptimizer`), ZeRO-1 (`DistributedOptimizer`), ZeRO-2 (`Zero2Optimizer`) and ZeRO-3
(`Zero3Optimizer`, FSDP2). A step is, in this order:

    start_step(m)              arm the gradient hooks for m backward passes
    (the schedule's forwards and backwards)
    reduce_and_clip(max_norm)  reduce over dp_cp_sp (and the tied embedding over its group),
                               return the global norm, clip
    step()                     update; the parameters are current again (or on their way:
                               finish_param_sync waits for the last all-gathers)
    zero_grad()

Per-parameter optimizer state (an fp32 main copy, an fp32 gradient accumulated over the
micro-batches, ZeRO's pieces of the main copy, whether a host-held gradient holds anything yet)
lives in the optimizer's `ParamStates` table, never on the parameter.

Gradients reduce over the group each parameter's ParamSpec names (`reduce_group`): dp_cp_sp for
dense parameters; a parameter marked otherwise (an expert's: expert data parallelism) is summed
over its own group in buckets of its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..mpu import host_staging
from ..mpu.comm_stats import record
from ..mpu.parallel_state import ParallelDims


@dataclass
class ParamState:
    """What the optimizer keeps for one model parameter."""

    main_grad: torch.Tensor | None = None  # fp32, accumulated micro-batch by micro-batch
    main_param: torch.Tensor | None = None  # the whole fp32 main copy (no ZeRO)
    # ZeRO-1/2 with a separate main copy: (first element in the parameter, fp32 piece of the
    # main copy) this rank owns, possibly none; None where the parameter is its main copy
    main_shards: list[tuple[int, torch.Tensor]] | None = None
    host_grad_empty: bool = False  # a host-held main_grad no micro-batch wrote this step


class ParamStates:
    """The optimizer's per-parameter table, keyed by the parameter object."""

    def __init__(self) -> None:
        self._states: dict[int, ParamState] = {}
        self._params: dict[int, torch.Tensor] = {}  # keeps the keys' objects alive

    def __getitem__(self, p: torch.Tensor) -> ParamState:
        state = self._states.get(id(p))
        if state is None:
            state = self._states[id(p)] = ParamState()
            self._params[id(p)] = p
        return state

    def get(self, p: torch.Tensor) -> ParamState | None:
        return self._states.get(id(p))

    def grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient reduced, clipped and applied: the fp32 main_grad where there is one
        (a host-held one no micro-batch wrote this step is zeroed first), else p.grad."""
        state = self._states.get(id(p))
        if state is None or state.main_grad is None:
            return p.grad
        if state.host_grad_empty:  # no copy targets it: zeroing on the host is safe
            state.main_grad.zero_()
            state.host_grad_empty = False
        return state.main_grad


class TrainingOptimizer(ABC):
    """The contract (see the module docstring). `param_groups` are the inner torch optimizer's
    (the LR schedule sets their lr)."""

    dims: ParallelDims
    states: ParamStates
    params: list[torch.nn.Parameter]  # the model's trainable parameters on this rank
    tied: list[torch.nn.Parameter]  # weights tied across pipeline stages (summed first)
    optimizer: torch.optim.Optimizer  # the torch AdamW doing the update

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch AdamW that updates (main copies, pieces or shards): `optimizer`, as
        megatron-core names it."""
        return self.optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.torch_optimizer.param_groups

    def start_step(self, num_micro_batches: int) -> None:
        """Arm the gradient hooks for a step of `num_micro_batches` backward passes."""
        del num_micro_batches

    @abstractmethod
    def reduce_and_clip(self, max_norm: float) -> float:
        """Finish the gradient reduction, clip to `max_norm` (0: no clipping); returns the
        global norm before clipping (the same on every rank)."""

    @abstractmethod
    def step(self) -> None: ...

    @abstractmethod
    def zero_grad(self) -> None: ...

    def finish_param_sync(self) -> None:
        """Wait for parameter all-gathers still in flight (anything that reads the
        parameters outside a forward calls this first)."""
        return None  # nothing in flight unless the kind all-gathers parameters

    def main_param(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The tensor a checkpoint reads and writes for p: its fp32 main copy, or p."""
        state = self.states.get(p)
        return state.main_param if state is not None and state.main_param is not None else p

    def main_shards(self, p: torch.nn.Parameter) -> list[tuple[int, torch.Tensor]] | None:
        """ZeRO-1/2 with a separate fp32 main copy: this rank's pieces of p's (possibly none);
        None where main_param(p) is the main copy."""
        state = self.states.get(p)
        return state.main_shards if state is not None else None

    @property
    def shards_flat_buffer(self) -> bool:
        """ZeRO-1/2: the Adam state lives in pieces of one flat buffer, one set per rank."""
        return False

    def copy_main_to_model(self) -> None:
        """Round the main copies into the model's parameters (after a checkpoint load)."""
        return None  # the parameters are the main copies

    def state_dict(self) -> dict:
        return self.torch_optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.torch_optimizer.load_state_dict(state)

    def grad(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The gradient of p this rank reduces, clips and applies (None: none yet)."""
        return self.states.grad(p)

    def local_grads(self) -> list[torch.Tensor]:
        """Every gradient this rank holds now (the fp16 loss scaler unscales them before
        the reduction)."""
        return [g for p in self.params if (g := self.grad(p)) is not None]

    # ---- shared by the implementations -----------------------------------------------------
    def sum_tied_grads(self, grads: Iterable[torch.Tensor] | None = None) -> None:
        """Megatron's _allreduce_embedding_grads: sum the tied table's gradient over the first
        and last pipeline stage, so both copies take the same step (`grads`: the tensors to
        sum, default the tied weights' gradients)."""
        dims = self.dims
        if dims.pp == 1 or not self.tied or dist.get_rank() not in dims.embedding_ranks:
            return
        group = dims.embedding_group
        if grads is None:
            grads = [self._tied_grad(p) for p in self.tied]
        for grad in grads:
            if host_staging.is_host_held(grad):  # NCCL takes no CPU tensor
                host_staging.all_reduce_flat([grad], group)
                continue
            record("all_reduce", grad, group)
            dist.all_reduce(grad, group=group)

    def _tied_grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        if self.grad(p) is None:  # the stage's copy took no gradient: it still joins the sum
            p.grad = torch.zeros_like(p)
        grad = self.grad(p)
        assert grad is not None
        return grad
