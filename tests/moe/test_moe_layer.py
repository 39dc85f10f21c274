"""The MoE layer on one rank against a plain per-token PyTorch computation: each token's
output is the sum over its chosen experts of probability × that expert's SwiGLU MLP (+ the
shared expert), with the router's top-k, softmax and capacity rule written out token by token."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ul.config import ModelConfig
from megatron_ul.model.moe.layer import MoELayer
from megatron_ul.mpu.parallel_state import single_rank_dims

S, B, H, E, K = 6, 3, 16, 4, 2


def _layer(dtype=torch.float64, **moe) -> MoELayer:
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=2,
        swiglu=True,
        add_bias_linear=False,
        num_experts=E,
        moe_router_topk=K,
        moe_ffn_hidden_size=8,
        init_method_std=0.3,
        **moe,
    )
    return MoELayer(cfg, "layers.1.mlp", 3, False, 1, None, dtype, dims=single_rank_dims())


def _swiglu(x, fc1, fc2):
    gate, up = (x @ fc1.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ fc2.t()


def _reference(layer: MoELayer, x: torch.Tensor, capacity_factor=None) -> torch.Tensor:
    tokens = x.reshape(-1, H)
    logits = tokens @ layer.router.weight.t()
    chosen = []  # per token: [(expert, prob)]
    for row in logits:
        top = sorted(range(E), key=lambda e: -float(row[e]))[:K]
        probs = torch.softmax(row[top].float(), dim=0).double()  # the router's fp32 softmax
        chosen.append(list(zip(top, probs)))
    if capacity_factor is not None:  # keep each expert's highest-probability tokens
        capacity = math.ceil(len(chosen) * K / E * capacity_factor)
        for e in range(E):
            users = [(float(p), t) for t, pairs in enumerate(chosen) for f, p in pairs if f == e]
            dropped = {t for _, t in sorted(users, reverse=True)[capacity:]}
            chosen = [
                [(f, p) for f, p in pairs if not (f == e and t in dropped)]
                for t, pairs in enumerate(chosen)
            ]
    out = torch.zeros_like(tokens)
    for t, pairs in enumerate(chosen):
        for e, p in pairs:
            expert = layer.experts.local_experts[str(e)]
            w1, w2 = expert.linear_fc1.weight, expert.linear_fc2.weight
            out[t] += p * _swiglu(tokens[t], w1, w2)
    out = out.view_as(x)
    if layer.shared_experts is not None:
        shared = layer.shared_experts
        out = out + _swiglu(x, shared.linear_fc1.weight, shared.linear_fc2.weight)
    return out


@pytest.mark.parametrize(
    "moe",
    [
        {},
        {"moe_token_dispatcher_type": "alltoall"},
        {"moe_expert_capacity_factor": 0.5},
        {"moe_shared_expert_intermediate_size": 12},
    ],
    ids=["allgather", "alltoall", "capacity", "shared"],
)
def test_moe_layer_matches_per_token_reference(moe):
    layer = _layer(**moe)
    x = torch.randn(S, B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = layer(x)
    with torch.no_grad():
        want = _reference(layer, x, moe.get("moe_expert_capacity_factor"))
    torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-12)


def test_grouped_gemm_equals_per_expert_matmuls():
    """--moe-grouped-gemm (torch._grouped_mm, fp32) against one matmul pair per expert:
    outputs and every gradient."""
    per_expert, grouped = _layer(torch.float32), _layer(torch.float32, moe_grouped_gemm=True)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
    results = []
    for layer in (per_expert, grouped):
        x.grad = None
        out = layer(x)
        (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
        grads = [p.grad.clone() for p in layer.parameters()]
        results.append((out.detach(), x.grad.clone(), grads))
    (out_a, dx_a, g_a), (out_b, dx_b, g_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx_b, dx_a, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
