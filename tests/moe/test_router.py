"""The router against megatron-core's own routing and loss functions on the same logits
(megatron-core is the test-only reference; skipped where it is not installed)."""

from __future__ import annotations

import pytest
import torch

from megatron_ul.model.moe.router import (
    TopKRouter,
    drop_over_capacity,
    expert_capacity,
    load_balancing_loss,
    topk_routing,
    z_loss,
)
from megatron_ul.mpu.param_init import Normal

moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

TOKENS, EXPERTS = 48, 8


def _logits(seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS, EXPERTS, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("pre_softmax", [False, True])
@pytest.mark.parametrize("topk", [1, 2, 3])
def test_topk_routing_matches_megatron_core(topk, pre_softmax):
    logits = _logits(topk)
    probs, routing_map = topk_routing(logits, topk, pre_softmax)
    ref_probs, ref_map = moe_utils.topk_routing_with_score_function(
        logits, topk, use_pre_softmax=pre_softmax
    )
    assert torch.equal(routing_map, ref_map)
    torch.testing.assert_close(probs, ref_probs, rtol=0, atol=0)


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5, 100.0])
def test_capacity_dropping_matches_megatron_core(factor, policy, pad):
    topk = 2
    probs, routing_map = topk_routing(_logits(7), topk, False)
    got_probs, got_map = drop_over_capacity(probs, routing_map, topk, factor, policy, pad)
    ref_probs, ref_map = moe_utils.apply_router_token_dropping(
        probs, routing_map, topk, factor, policy, pad
    )
    capacity = expert_capacity(TOKENS * topk, EXPERTS, factor)
    assert capacity == moe_utils.get_capacity(TOKENS * topk, EXPERTS, factor)
    if policy == "position" and capacity <= TOKENS:
        # megatron-core takes whichever rows its top-k over the 0/1 map returns among equal
        # values (unspecified: the CPU's returns the last ones); ours are the first, the
        # policy's meaning (test_position_policy_keeps_the_first_tokens). Every expert's
        # count and probability mass per kept row must agree.
        assert torch.equal(got_map.sum(0), ref_map.sum(0))
        assert torch.equal(got_probs[got_map], probs[got_map])
    else:
        assert torch.equal(got_map, ref_map)
        torch.testing.assert_close(got_probs, ref_probs, rtol=0, atol=0)
    if not pad and capacity < TOKENS * topk // EXPERTS:
        assert (got_map.sum(0) <= capacity).all() and got_map.sum() < routing_map.sum()


def test_position_policy_keeps_the_first_tokens():
    """Independent of megatron-core: each expert keeps its first `capacity` chosen tokens."""
    topk, factor = 2, 0.5
    probs, routing_map = topk_routing(_logits(3), topk, False)
    _, got = drop_over_capacity(probs, routing_map, topk, factor, "position")
    capacity = expert_capacity(TOKENS * topk, EXPERTS, factor)
    for e in range(EXPERTS):
        rows = routing_map[:, e].nonzero().flatten().tolist()
        assert got[:, e].nonzero().flatten().tolist() == rows[:capacity]


def test_losses_match_megatron_core():
    logits = _logits(11)
    scores = torch.softmax(logits, -1)
    counts = torch.zeros_like(scores).scatter(1, scores.topk(2, 1).indices, 1.0).sum(0)
    ours = load_balancing_loss(scores, counts, TOKENS, 2, EXPERTS, 0.01)
    ref = moe_utils.switch_load_balancing_loss_func(scores, counts, TOKENS, 2, EXPERTS, 0.01)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(z_loss(logits, 1e-3), moe_utils.z_loss_func(logits, 1e-3))


def _router(kind: str, **kw) -> TopKRouter:
    return TopKRouter(
        16,
        EXPERTS,
        2,
        Normal(0.5, 1, "router"),
        load_balancing=kind,
        aux_loss_coeff=0.01,
        z_loss_coeff=1e-3,
        dtype=torch.float64,
        **kw,
    )


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_router_gradient_is_lm_plus_aux_losses(kind):
    """The router weight's gradient from its outputs alone (the aux losses riding on them via
    the scaler) equals autograd of the explicit sum of megatron-core's loss functions."""
    seq, batch = 12, 4
    router = _router(kind)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(seq * batch, 16, dtype=torch.float64, generator=g)
    router.aux_loss_scale = 0.25
    probs, routing_map = router(x, seq)
    weight = torch.randn(probs.shape, dtype=torch.float64)
    (probs * weight).sum().backward()
    got = router.weight.grad.clone()

    w = router.weight.detach().clone().requires_grad_(True)
    logits = x @ w.t()
    ref_probs, ref_map = moe_utils.topk_routing_with_score_function(logits, 2)
    assert torch.equal(routing_map, ref_map)
    _, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, 2, "softmax")
    chosen = torch.zeros_like(scores).scatter(1, scores.topk(2, 1).indices, 1.0)
    if kind == "aux_loss":
        aux = moe_utils.switch_load_balancing_loss_func(
            scores, chosen.sum(0), seq * batch, 2, EXPERTS, 0.01
        )
    else:  # megatron-core's _apply_seq_aux_loss: sequences as separate expert columns
        aux = (
            moe_utils.switch_load_balancing_loss_func(
                scores.reshape(seq, -1),
                chosen.reshape(seq, -1).sum(0),
                seq,
                2,
                EXPERTS,
                0.01,
            )
            / batch
        )
    total = (ref_probs * weight).sum() + 0.25 * (aux + moe_utils.z_loss_func(logits, 1e-3))
    total.backward()
    torch.testing.assert_close(got, w.grad, rtol=1e-10, atol=1e-14)
    name = "load_balancing_loss" if kind == "aux_loss" else "seq_load_balancing_loss"
    torch.testing.assert_close(router.logged[name], aux.detach() / 0.01)


def test_router_without_aux_losses_has_only_the_routing_gradient():
    router = TopKRouter(
        16, EXPERTS, 2, Normal(0.5, 1, "router"), load_balancing="none", dtype=torch.float64
    )
    x = torch.randn(24, 16, dtype=torch.float64)
    probs, _ = router(x, 24)
    probs.sum().backward()
    # softmax over the chosen k sums to one per token: no gradient but the fp32 softmax's
    # rounding
    assert router.weight.grad.abs().max() < 1e-6
    assert router.logged == {}
