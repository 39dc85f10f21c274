"""The MoE layer: what fills a transformer layer's MLP slot on MoE layers (--num-experts,
--moe-layer-freq). Router → dispatch over EP → experts → combine, plus the shared expert.

Input and output are the dense MLP's: [s, b, h], or [s/TP, b, h] under Megatron-SP. With TP > 1
the experts are TP-split (expert-TP = TP) and need every TP rank to see the same tokens:
  - Megatron-SP: each TP rank routes its own s/TP tokens (the router's gradient sums over TP,
    as a Megatron-SP weight's); tokens and probabilities are all-gathered over TP,
    whose backward reduce-scatters the partial gradients the TP-split experts produce; the
    partial output is reduce-scattered back to s/TP;
  - without it the TP ranks hold the same tokens and route them alike; the expert branch's
    input and probabilities enter through copy_to_tensor_model_parallel_region (backward:
    all-reduce of the partial gradients) and the partial output is all-reduced.
"""

from __future__ import annotations

import torch
from torch import nn

from ...config import ModelConfig
from ...mpu.mappings import (
    all_gather,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from ...mpu.parallel_state import ParallelDims
from ..activation_shape import ActivationShape
from ..init import normal_init
from .dispatcher import AllGatherDispatcher, AllToAllDispatcher
from .experts import Experts, SharedExpert
from .router import TopKRouter, aux_loss_names, take_aux_losses


class MoELayer(nn.Module):
    """Takes the dense MLP's constructor arguments (model/layer_spec.py builds either)."""

    def __init__(
        self,
        cfg: ModelConfig,
        key: str,
        seed: int,
        sequence_parallel: bool,
        num_layers: int,
        device,
        dtype,
        *,
        dims: ParallelDims,
    ):
        super().__init__()
        assert cfg.num_experts is not None
        self.tp_group = dims.tp_group
        self.split_tokens = sequence_parallel and dims.tp > 1
        # The ranks that split one micro-batch's tokens: the aux losses' parts add up there.
        token_group = dims.groups.cp_sp_tp if self.split_tokens else dims.groups.cp_sp
        self.router = TopKRouter(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.moe_router_topk,
            normal_init(cfg.init_method_std, seed, key + ".router"),
            pre_softmax=cfg.moe_router_pre_softmax,
            load_balancing=cfg.moe_router_load_balancing_type,
            aux_loss_coeff=cfg.moe_aux_loss_coeff,
            z_loss_coeff=cfg.moe_z_loss_coeff,
            capacity_factor=cfg.moe_expert_capacity_factor,
            drop_policy=cfg.moe_token_drop_policy,
            pad_to_capacity=cfg.moe_pad_expert_input_to_capacity,
            sequence_parallel=sequence_parallel,
            token_group=token_group,
            device=device,
            dtype=dtype,
        )
        self.experts = Experts(
            cfg,
            key,
            seed,
            device,
            dtype,
            ep_rank=dims.ep_rank,
            ep_size=dims.ep,
            tp_group=dims.tp_group,
        )
        dispatcher = (
            AllToAllDispatcher
            if cfg.moe_token_dispatcher_type == "alltoall"
            else AllGatherDispatcher
        )
        self.dispatcher = dispatcher(cfg.num_experts, dims.groups.ep)
        self.shared_experts: SharedExpert | None = None
        if cfg.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExpert(
                cfg,
                cfg.moe_shared_expert_intermediate_size,
                key + ".shared_experts",
                seed,
                sequence_parallel,
                device,
                dtype,
                tp_group=dims.tp_group,
            )
        self.topk, self.ffn, self.swiglu = cfg.moe_router_topk, cfg.moe_ffn_size, cfg.swiglu
        self.hidden = cfg.hidden_size
        self.saved_blocks = 4 if cfg.swiglu else 2  # the dense MLP's count, for the estimator
        self.tile_tokens = None  # never tiled (config_rules refuses --tiled-mlp-chunk-size)
        self.layer_number = int(key.split(".")[1])  # key: "layers.<n>.mlp"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        probs, routing_map = self.router(tokens, s)
        tp = self.tp_group
        if self.split_tokens:
            tokens = gather_from_sequence_parallel_region(tokens, True, group=tp)
            probs = gather_from_sequence_parallel_region(probs, True, group=tp)
            routing_map = all_gather(routing_map, 0, tp)
        else:
            tokens = copy_to_tensor_model_parallel_region(tokens, tp)
            probs = copy_to_tensor_model_parallel_region(probs, tp)
        rows, counts, state = self.dispatcher.dispatch(tokens, probs, routing_map)
        out = self.dispatcher.combine(self.experts(rows, counts), state)
        if self.split_tokens:
            out = reduce_scatter_to_sequence_parallel_region(out, tp)
        else:
            out = reduce_from_tensor_model_parallel_region(out, tp)
        out = out.view(s, b, h)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    # What the memory estimator asks of an MLP (model/mlp.py): the routed experts keep, for
    # top-k copies of each token, the dense MLP's ffn-wide blocks at the expert's width, plus
    # the dispatched rows and their outputs.
    def saved_bytes(self, shape: ActivationShape) -> float:
        blocks = 4 if self.swiglu else 2
        pairs = self.topk * shape.tokens
        routed = pairs * (blocks * self.ffn / shape.tp + 2 * self.hidden) * shape.act_bytes
        shared = 0.0
        if self.shared_experts is not None:
            width = self.shared_experts.linear_fc2.weight.shape[1]
            shared = blocks * shape.tokens * width / shape.tp * shape.act_bytes
        return routed + shared

    def gradient_bytes(self, shape: ActivationShape) -> float:
        return 0.75 * self.saved_bytes(shape)


def moe_routers(model: nn.Module) -> dict[int, TopKRouter]:
    """{global layer number: router} of the MoE layers in `model` (all its chunks)."""
    routers = {}
    for module in model.modules():
        if isinstance(module, MoELayer):
            routers[module.layer_number] = module.router
    return routers


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The gradient each aux loss gets (router.py's module docstring)."""
    for router in moe_routers(model).values():
        router.aux_loss_scale = scale


def aux_loss_report(model: nn.Module, cfg: ModelConfig, dims: ParallelDims, device) -> dict:
    """The aux losses since the last report, per MoE layer and averaged over the layers
    (router.take_aux_losses); every rank calls it (collective)."""
    layers = [n for n in range(1, cfg.num_layers + 1) if cfg.is_moe_layer(n)]
    names = aux_loss_names(
        cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
    )
    return take_aux_losses(moe_routers(model), layers, names, dims, device)
