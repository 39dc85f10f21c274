"""--dry-run: print the resolved layout and a per-GPU memory estimate, without starting
torch.distributed or building the model."""

from __future__ import annotations

import math
import sys

import torch

from ..config import ResolvedConfig
from ..model.attention.backends import planned_kernel
from ..model.attention.block_sparse_layouts import computed_blocks
from ..model.attention.dispatch import AttentionCall
from ..model.attention.layer import model_call
from ..sparsity_config import SparsityPattern
from .memory_estimator import (
    RESERVE_GIB,
    GiB,
    estimate_config,
    init_peak_bytes,
    layout_flags,
    layout_from_config,
    memory_budget_bytes,
    recompute_of,
    smallest_fitting_layout,
)


def _number(x: float) -> str:
    """2^32 rather than 4.29497e+09."""
    exponent = math.log2(x) if x > 0 else 0.5
    return f"2^{int(exponent)}" if exponent == int(exponent) and x >= 1024 else f"{x:g}"


def run_precision(cfg: ResolvedConfig) -> tuple[str, torch.dtype]:
    """(description, activation dtype) of the precision a run with these flags uses."""
    t = cfg.train
    if t.bf16:
        return "bf16 model (fp32 main parameters, gradients and Adam state)", torch.bfloat16
    if t.fp16:
        scale = (
            f"constant loss scale {_number(t.loss_scale)}"
            if t.loss_scale is not None
            else f"dynamic loss scaling from {_number(t.initial_loss_scale)}"
        )
        return (
            f"fp16 model (fp32 main parameters, gradients and Adam state; {scale})",
            torch.float16,
        )
    return "fp32", torch.float32


def attention_call(cfg: ResolvedConfig, device: torch.device) -> AttentionCall:
    """The attention call every layer of this run makes in training on `device` (the one
    description the layers build: layer.model_call)."""
    p = cfg.parallel
    return model_call(
        cfg.model,
        device,
        run_precision(cfg)[1],
        tp=p.tensor_model_parallel_size,
        sp=p.ds_sequence_parallel_size,
        cp=p.context_parallel_size,
        documents=cfg.data.reset_attention_mask,
    )


def describe(cfg: ResolvedConfig) -> str:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp, sp, pp, dp = (
        p.tensor_model_parallel_size,
        p.ds_sequence_parallel_size,
        p.pipeline_model_parallel_size,
        p.data_parallel_size,
    )
    cp = p.context_parallel_size
    est = estimate_config(cfg)
    zero = p.zero_stage
    precision, activation_dtype = run_precision(cfg)
    activation_bytes = torch.empty((), dtype=activation_dtype).element_size()
    lines = [
        f"world {p.world_size} = TP {tp} × SP {sp}{f' × CP {cp}' if cp > 1 else ''} × PP {pp} "
        f"× DP {dp}"
        f"{' (Megatron-SP on)' if p.sequence_parallel else ''}",
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
        f"({m.query_groups} kv groups), ffn {m.ffn_size}, seq {m.seq_length} "
        f"({m.seq_length // (sp * cp)} tokens per "
        f"{'Ulysses × ring' if cp > 1 else 'Ulysses'} rank), padded vocab "
        f"{m.padded_vocab_size(tp)}",
        f"batch: micro {t.micro_batch_size} × {cfg.num_micro_batches} micro-batches × DP {dp} "
        f"= global {t.global_batch_size} ({t.global_batch_size * m.seq_length} tokens/iter)",
        f"parameters per rank: {est.params_per_rank / 1e6:.1f} M; precision {precision}, "
        f"{activation_bytes}-byte activations; ZeRO stage {zero}; recompute "
        f"{recompute_of(cfg)}",
        *([moe_plan(cfg, activation_bytes)] if m.num_experts is not None else []),
        "attention kernel on a GPU: " + planned_kernel(attention_call(cfg, torch.device("cuda"))),
        "long context: " + long_context(cfg),
        "memory estimate per GPU: " + est.describe(),
        f"initialisation peak per GPU: "
        f"{init_peak_bytes(m, layout_from_config(cfg), zero) / GiB:.2f} GiB (each rank computes "
        f"only the parameters it holds, on its device)",
    ]
    return "\n".join(lines)


def moe_plan(cfg: ResolvedConfig, activation_bytes: int) -> str:
    """The experts each rank holds, the tokens' share of them (FLOPs count the top-k only:
    training/metrics.py), and the rows an all-to-all dispatch moves per MoE layer: forward
    and backward each send and return T·k rows, (EP-1)/EP of them off the rank
    (tools/bench/bench_moe.py measures this)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    ep, e, k = p.expert_model_parallel_size, m.num_experts, m.moe_router_topk
    assert e is not None
    moe_layers = sum(m.is_moe_layer(i + 1) for i in range(m.num_layers))
    tokens = (
        t.micro_batch_size * m.seq_length / (p.ds_sequence_parallel_size * p.context_parallel_size)
    )
    moved = 4 * tokens * k * m.hidden_size * activation_bytes * (ep - 1) / ep
    shared = m.moe_shared_expert_intermediate_size
    return (
        f"experts: {moe_layers} MoE layers of {e} experts (ffn {m.moe_ffn_size}"
        f"{f', shared expert {shared}' if shared else ''}), top-{k}; EP {ep}: {e // ep} experts "
        f"per rank; {p.expert_model_parallel_size > 1 and m.moe_token_dispatcher_type or 'no'} "
        f"dispatch, {moved / 2**20:.1f} MiB sent per rank per MoE layer per micro-batch"
    )


def long_context(cfg: ResolvedConfig) -> str:
    """The long-sequence options in effect (docs/long_context.md)."""
    m, d = cfg.model, cfg.data
    parts = [
        f"tiled loss {m.tiled_loss_chunk_size} tokens/chunk"
        if m.tiled_loss_chunk_size
        else "loss untiled",
        f"tiled MLP {m.tiled_mlp_chunk_size} tokens/chunk"
        if m.tiled_mlp_chunk_size
        else "MLP untiled",
    ]
    if m.attention_block_tiles > 1:
        parts.append(f"attention block in {m.attention_block_tiles} tiles")
    if m.activation_checkpoint_cpu_offload:
        parts.append("full-recompute layer inputs offloaded to host")
    if d.reset_attention_mask:
        parts.append("document masking (O(N) cu_seqlens)")
    if m.attention_window is not None:
        parts.append(f"sliding window {m.attention_window}")
    if m.sparse_attention is not None:
        parts.append(sparse_attention_plan(cfg))
    return "; ".join(parts)


def sparse_attention_plan(cfg: ResolvedConfig) -> str:
    """The block-sparse pattern, the share of the causal blocks it computes (layer 0's
    layout, the run's seed); the kernel is the attention line's (the backend table's row)."""
    m = cfg.model
    pattern = SparsityPattern.of(m)
    assert pattern is not None
    blocks = m.seq_length // pattern.block
    computed = computed_blocks(pattern, m.num_attention_heads, m.seq_length, seed=cfg.train.seed)
    share = computed / (m.num_attention_heads * blocks * (blocks + 1) / 2)
    return (
        f"block-sparse {pattern.mode} attention, block {pattern.block}: {share:.1%} of the "
        f"causal blocks computed (as blocks of the blocked attention engine)"
    )


def fit_problem(cfg: ResolvedConfig) -> str | None:
    """Why the plan does not fit --gpu-memory-gb (naming the largest term and the fewest GPUs
    that would fit), or None."""
    gpu_gb = cfg.train.gpu_memory_gb
    if gpu_gb is None:
        return None
    est = estimate_config(cfg)
    budget = memory_budget_bytes(gpu_gb)
    if est.total_bytes <= budget:
        return None
    name, value = est.largest_term()
    found = smallest_fitting_layout(cfg, gpu_gb)
    fewest = (
        f"; {found[0].parallel.world_size} GPUs would fit ({layout_flags(found[0])})"
        if found is not None
        else ""
    )
    return (
        f"the plan does not fit --gpu-memory-gb {gpu_gb:g} ({budget / GiB:g} GiB once "
        f"{RESERVE_GIB:g} GiB are kept for the CUDA context): estimated "
        f"{est.total_bytes / GiB:.1f} GiB per GPU at its peak ({est.peak_phase}); the "
        f"largest term is {name} ({value / GiB:.1f} GiB){fewest}"
    )


def dry_run(cfg: ResolvedConfig) -> int:
    print(describe(cfg), flush=True)
    problem = fit_problem(cfg)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return 1
    print(
        f"dry run: configuration is valid; estimated "
        f"{estimate_config(cfg).total_bytes / GiB:.1f} GiB per GPU (+ CUDA context); "
        f"not training",
        flush=True,
    )
    return 0
