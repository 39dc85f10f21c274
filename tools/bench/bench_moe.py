#!/usr/bin/env python
"""Mixture of experts, one layer's MLP slot, forward and backward:

1. dense MLP against MoE at equal ACTIVE parameters (E experts of ffn F/k, top-k, against one
   MLP of ffn F): tokens/s and peak memory (live tensors, tools/bench/live_tensors.py; the
   CUDA allocator's peak on a GPU), and the experts run per expert (one matmul pair each)
   against torch._grouped_mm (--moe-grouped-gemm), side by side in one run;
2. bytes the token exchange sends per rank and layer, EP = 2 and 4 (`mpu/comm_stats.py`'s
   count), against the formula: dispatch, combine and their two backward exchanges each move
   T·k rows of h elements over the EP group (a rank keeps 1/EP of them), plus the E counts.

    python -m tools.bench.bench_moe [--tokens 4096 --hidden-size 512] [--write-docs]
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_ul.config import ModelConfig
from megatron_ul.model.layer_spec import layer_spec
from megatron_ul.model.moe.layer import MoELayer
from megatron_ul.mpu import comm_stats
from megatron_ul.mpu import parallel_state as ps
from megatron_ul.mpu.random import model_parallel_seed
from tools.bench.common import markdown_table, report, run_ranks
from tools.bench.live_tensors import LiveTensorTracker


def _config(hidden, ffn, experts=None, topk=2, grouped=False) -> ModelConfig:
    return ModelConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=8,
        ffn_hidden_size=ffn,
        swiglu=True,
        add_bias_linear=False,
        num_experts=experts,
        moe_router_topk=topk,
        moe_grouped_gemm=grouped,
        moe_token_dispatcher_type="alltoall",
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )


def _mlp(cfg: ModelConfig, dims, device):
    spec = layer_spec(cfg)
    kind = spec.mlp_for(cfg, 1)
    return kind(cfg, "layers.1.mlp", 1, False, 1, device, torch.float32, dims=dims)


def time_and_peak(cfg, tokens, device, iters=5):
    """(tokens/s, peak live bytes) of forward + backward of the MLP slot."""
    dims = ps.single_rank_dims()
    mlp = _mlp(cfg, dims, device)
    x = torch.randn(tokens, 1, cfg.hidden_size, device=device, requires_grad=True)
    mlp(x).sum().backward()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        mlp(x).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = tokens * iters / (time.perf_counter() - start)
    with LiveTensorTracker(mlp) as tracker:
        tracker.phase = "step"
        mlp(x).sum().backward()
    return rate, tracker.peaks["step"].bytes


def exchange_bytes(rank, world, tokens, hidden, experts, topk):
    """Bytes this rank's all-to-alls send in one MoE layer's forward and backward."""
    dims = ps.initialize_model_parallel(1, 1, 1, expert_model_parallel_size=world)
    model_parallel_seed(1, dims, "cpu")
    cfg = _config(hidden, 4 * hidden, experts, topk)
    layer = MoELayer(cfg, "layers.1.mlp", 1, False, 1, None, torch.float32, dims=dims)
    x = torch.randn(tokens, 1, hidden, requires_grad=True)
    with comm_stats.count_communication() as sent:
        layer(x).sum().backward()
    return sent["all_to_all"]["bytes"], sent["all_to_all"]["calls"]


def formula(tokens, hidden, experts, topk, ep, elem=4, count_elem=8) -> float:
    """Mean bytes one rank sends per layer (forward + backward): four exchanges of T·k rows,
    (EP-1)/EP of which leave the rank, and the counts' exchange."""
    return (4 * tokens * topk * hidden * elem + experts * count_elem) * (ep - 1) / ep


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t, h, e, k = args.tokens, args.hidden_size, args.experts, args.topk
    ffn = 4 * h
    runs = {
        "dense MLP (ffn F)": _config(h, ffn),
        f"MoE {e}×(F/{k}), top-{k}, per expert": _config(h, ffn // k, e, k),
        f"MoE {e}×(F/{k}), top-{k}, grouped GEMM": _config(h, ffn // k, e, k, grouped=True),
    }
    measured = {name: time_and_peak(cfg, t, device) for name, cfg in runs.items()}
    dense_rate, dense_peak = measured["dense MLP (ffn F)"]
    rows = [
        [
            name,
            f"{rate:.0f}",
            f"{rate / dense_rate:.2f}",
            f"{peak / 2**20:.1f}",
            f"{peak / dense_peak:.2f}",
        ]
        for name, (rate, peak) in measured.items()
    ]
    speed = markdown_table(["MLP slot", "tokens/s", "vs dense", "peak MiB", "vs dense"], rows)
    exchange_rows = []
    for ep in (2, 4):
        per_rank = run_ranks(exchange_bytes, ep, t // ep, h, e, k)
        mean = sum(b for b, _ in per_rank) / ep
        want = formula(t // ep, h, e, k, ep)
        exchange_rows.append(
            [
                ep,
                t // ep,
                per_rank[0][1],
                f"{mean / 2**20:.3f}",
                f"{want / 2**20:.3f}",
                f"{mean / want:.4f}",
            ]
        )
    exchange = markdown_table(
        [
            "EP",
            "tokens per rank T",
            "all-to-alls",
            "measured MiB/rank",
            "formula MiB/rank",
            "ratio",
        ],
        exchange_rows,
    )
    report(
        "moe",
        "Mixture of experts: dense vs MoE at equal active parameters, and the token exchange",
        f"One MLP slot, forward + backward, fp32 on {device.type}, {t} tokens, h = {h}, SwiGLU, "
        f"F = {ffn}; MoE: {e} experts of F/{k}, top-{k} (active parameters equal the dense "
        f"MLP's, plus the router). Exchange: all-to-all dispatcher, EP ranks each with T = "
        f"{t}/EP tokens; formula (4·T·k·h·4 B + E·8 B)·(EP-1)/EP.",
        f"{speed}\n\n{exchange}",
        write_docs=args.write_docs,
    )


if __name__ == "__main__":
    main()
