"""ZeRO-3 over the DP×SP group (--zero-stage 3) with PyTorch FSDP2, composed with our TP.

`shard_model` applies `fully_shard` to every transformer layer and then to the root (the
embeddings, final norm and head) on a 1-D DeviceMesh over the dp_cp_sp ranks. Under expert
parallelism each layer's experts are sharded first, on their own 1-D mesh over expert-DP (the
replicas of the same experts; FSDP2 takes a mesh per fully_shard call), as megatron-core shards
expert parameters over the expert-data-parallel group; the gradient-norm argument below holds
unchanged, since each expert-DP group's local shards partition its experts. Under pipelining
every model chunk (GPTModel) of the PipelineStageModel is its own FSDP root: the schedule runs
one chunk's forward or backward at a time (several forwards before their backwards, which
FSDP2 supports), and each backward reduce-scatters into the accumulated gradient shards. The
tied embedding copies on the first and last stage are sharded identically (same dp_cp_sp
coordinates), so pipeline/model.py sums their local shards over the embedding group. Parameters
become DTensors sharded on dim 0 over dp_cp_sp; a TP-sharded parameter is, to FSDP2, just a smaller
local tensor, so TP needs nothing from it. FSDP2 all-gathers a layer's parameters for its
forward and backward and reduce-scatters its gradients; we set the divide factor to 1 and
force plain SUM collectives (gloo has no PREMUL_SUM), so the reduction is a SUM over dp_cp_sp,
the project's convention (training/step.py).

What FSDP2 does not know, `Zero3Optimizer` adds: Megatron-SP replicated weights' gradient
shards are all-reduced over TP, and the clipping norm is computed from the local gradient
shards (dp_cp_sp all-reduce, then the model-parallel group; TP-replicated parameters counted on
TP rank 0 only). The update is plain torch AdamW on the DTensor shards.
"""

from __future__ import annotations

from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..config import TrainConfig
from ..model.chunks import model_chunks
from ..model.moe.experts import Experts
from ..mpu.parallel_state import ParallelDims
from ..mpu.param_spec import param_spec
from .contract import ParamStates, TrainingOptimizer
from .grads import (
    all_reduce_coalesced,
    clip_coefficient,
    counts_once,
    grad_norm,
    sharded_like_dense,
)
from .replicated import adamw, weight_decay_groups

M = TypeVar("M", bound=nn.Module)  # sharded in place: the model handed in comes back


def shard_model(model: M, dims: ParallelDims, param_dtype: torch.dtype | None = None) -> M:
    """fully_shard each transformer layer, then each model chunk as a root, over the dp_cp_sp
    mesh of `dims`, in place; a PipelineStageModel stays a plain container.

    param_dtype (--bf16/--fp16): FSDP2's MixedPrecisionPolicy. The sharded parameters stay
    fp32 (they are the main copy AdamW steps); each all-gather casts them to param_dtype, so
    forward and backward run in half precision and the gathers move half the bytes; gradients
    are reduce-scattered and accumulated in fp32. Inputs are not cast (the model's residual
    dtype decides, see model/gpt.py)."""
    mesh = dims.dp_cp_sp_mesh
    # FSDP2 makes new Parameter objects: keep what our layers attached (spec, init_spec).
    saved = {name: dict(vars(p)) for name, p in model.named_parameters()}
    policy = (
        MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        if param_dtype is not None
        else MixedPrecisionPolicy()
    )
    expert_mesh = None
    sharded: list[FSDPModule] = []
    for chunk in model_chunks(model):
        for layer in cast(nn.ModuleList, chunk.layers):
            # Experts under EP > 1 first, over their own mesh: their replicas are expert-DP.
            for module in layer.modules():
                if module is layer or not isinstance(module, Experts):
                    continue
                if all(sharded_like_dense(p, dims) for p in module.parameters()):
                    continue
                if expert_mesh is None:
                    expert_mesh = _expert_dp_mesh(dims)
                sharded.append(fully_shard(module, mesh=expert_mesh, mp_policy=policy))
            sharded.append(fully_shard(layer, mesh=mesh, mp_policy=policy))
        sharded.append(fully_shard(chunk, mesh=mesh, mp_policy=policy))
    for fsdp in sharded:
        fsdp.set_gradient_divide_factor(1.0)  # SUM over its mesh, not the mean
        # Plain SUM collectives: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling.
        fsdp.set_force_sum_reduction_for_comms(True)
    for name, p in model.named_parameters():
        for attribute, value in saved[name].items():
            setattr(p, attribute, value)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _expert_dp_mesh(dims: ParallelDims):
    """1-D DeviceMesh over this rank's expert-DP group (the existing communicator)."""
    from torch.distributed.device_mesh import DeviceMesh

    device_type = "cuda" if dist.get_backend(dims.expert_dp_group) == "nccl" else "cpu"
    return DeviceMesh.from_group(dims.expert_dp_group, device_type, mesh_dim_names=("expert_dp",))


class Zero3Optimizer(TrainingOptimizer):
    """torch AdamW over the FSDP2 shards, plus the reduction and clipping FSDP2 leaves to us."""

    def __init__(self, model: torch.nn.Module, train: TrainConfig, dims: ParallelDims, *, tied=()):
        self.dims, self.states, self.tied = dims, ParamStates(), list(tied)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = adamw(weight_decay_groups(self.params, train), train, foreach=True)

    def grad(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The local shard of p's gradient (FSDP2 has reduce-scattered it already)."""
        return None if p.grad is None else _local(p.grad)

    @torch.no_grad()
    def reduce_and_clip(self, max_norm: float) -> float:
        # Both tied copies are sharded alike over their dp_cp_sp groups: summing the local
        # shards sums the tables.
        self.sum_tied_grads()
        with_grad = [(p, g) for p in self.params if (g := self.grad(p)) is not None]
        sequence_parallel = [g for p, g in with_grad if param_spec(p).sequence_parallel]
        all_reduce_coalesced(sequence_parallel, self.dims.tp_group)
        counted = [g for p, g in with_grad if counts_once(p, self.dims)]
        groups = (self.dims.dp_cp_sp_group, self.dims.pp_tp_group)
        norm = grad_norm(counted, self.params[0].device, groups)
        coeff = clip_coefficient(norm, max_norm)
        if coeff < 1.0:
            for _, g in with_grad:
                g.mul_(coeff)
        return norm

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
