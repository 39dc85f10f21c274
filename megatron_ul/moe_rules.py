"""The rules between the MoE flags (model/moe/), called by config_rules.problems: pure checks,
each naming its flags, run before any process group or model exists."""

from __future__ import annotations

import torch

from .config import Config


def moe_problems(cfg: Config) -> list[str]:
    m, p = cfg.model, cfg.parallel
    ep = p.expert_model_parallel_size
    if m.num_experts is None:
        if ep > 1 or p.expert_tensor_parallel_size not in (None, 1):
            return [
                "--expert-model-parallel-size / --expert-tensor-parallel-size need "
                "--num-experts (a model with MoE layers)"
            ]
        return []
    errors = []
    tp = p.tensor_model_parallel_size
    if m.moe_router_topk > m.num_experts:
        errors.append(
            f"--moe-router-topk {m.moe_router_topk} is above --num-experts {m.num_experts}: "
            f"a token cannot go to more experts than there are"
        )
    if m.num_experts % ep:
        errors.append(
            f"--num-experts {m.num_experts} is not divisible by --expert-model-parallel-size "
            f"{ep}: every EP rank holds the same number of experts"
        )
    dcs = p.data_parallel_size * p.context_parallel_size * p.ds_sequence_parallel_size
    if p.data_parallel_size >= 1 and dcs % ep:
        errors.append(
            f"--expert-model-parallel-size {ep} does not divide DP × CP × SP = {dcs} "
            f"(--context-parallel-size × --ds-sequence-parallel-size × the data-parallel "
            f"size): EP is carved from those ranks"
        )
    if p.expert_tensor_parallel_size not in (None, tp):
        errors.append(
            f"--expert-tensor-parallel-size {p.expert_tensor_parallel_size}: the experts are "
            f"split like the dense MLP, over --tensor-model-parallel-size {tp}; leave it unset "
            f"or give {tp}"
        )
    for flag, size in (
        ("--moe-ffn-hidden-size (default --ffn-hidden-size)", m.moe_ffn_size),
        ("--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size),
    ):
        if size is not None and size % tp:
            errors.append(f"{flag} {size} is not divisible by --tensor-model-parallel-size {tp}")
    if m.moe_expert_capacity_factor is None and m.moe_pad_expert_input_to_capacity:
        errors.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if m.add_bias_linear:
        errors.append(
            "--num-experts needs --disable-bias-linear: the experts have no biases "
            "(megatron-core's grouped experts have none either)"
        )
    if m.moe_grouped_gemm and not hasattr(torch, "_grouped_mm"):
        errors.append(
            "--moe-grouped-gemm: this torch has no torch._grouped_mm; drop the flag (the "
            "experts then run one matmul pair each)"
        )
    if m.tiled_mlp_chunk_size is not None:
        errors.append("--tiled-mlp-chunk-size does not apply to MoE layers (--num-experts)")
    if m.fused_layers:
        errors.append(
            "--fused-layers with --num-experts: the experts' row counts are data-dependent "
            "(one host read per layer), which torch.compile cannot trace as one graph"
        )
    return errors
