"""The blocked-attention engine (model/attention/blocks.py) on a block layout: the plan that
`layout_blocks` makes of a [nq, nk] 0/1 layout, run forward and backward on the CPU flash unit
kernel, equals softmax attention over the layout's dense token mask in fp64."""

import pytest
import torch

from megatron_ul.model.attention import blocks, lse_kernels
from megatron_ul.model.attention.blocks import Kernels, Mask, MaskRules, layout_blocks

BLOCK, NB, B, D = 4, 6, 2, 8


def _layout(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    layout = (torch.rand(NB, NB, generator=g) < 0.5).to(torch.int64)
    layout.fill_diagonal_(1)  # every query sees a key: no empty rows
    return layout


def _dense_mask(layout: torch.Tensor, causal: bool, window) -> torch.Tensor:
    hidden = ~layout.bool().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    pos = torch.arange(NB * BLOCK)
    if causal:
        hidden |= pos.unsqueeze(0) > pos.unsqueeze(1)
    if window is not None:
        hidden |= pos.unsqueeze(0) < pos.unsqueeze(1) - window
    return hidden


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 9)])
def test_layout_plan_matches_the_dense_mask_fp64(causal, window):
    layout = _layout(3)
    plan = layout_blocks(layout, BLOCK, causal=causal)
    assert {b.mask for b in plan} <= {Mask.FULL, Mask.CAUSAL}
    if window is not None:  # the window cuts blocks: they take the bias
        plan = [blocks.Block(b.q0, b.q1, b.k0, b.k1, Mask.BIAS) for b in plan]
    n = NB * BLOCK
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(n, B, h, D, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    out = torch.zeros_like(q)
    lse = torch.full((B, 4, n), float("-inf"), dtype=torch.float64)
    kernels = Kernels(lse_kernels.CPU_FLASH, lse_kernels.CPU_FLASH)
    rules = MaskRules(window)
    blocks.forward(q, k, v, out, lse, plan, kernels, rules, D**-0.5)
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    blocks.backward(w, q, k, v, out, lse, dq, dk, dv, plan, kernels, rules, D**-0.5)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kx, vx = (t.repeat_interleave(2, dim=2) for t in leaves[1:])
    scores = torch.einsum("ibhd,jbhd->bhij", leaves[0], kx) * D**-0.5
    probs = scores.masked_fill(_dense_mask(layout, causal, window), float("-inf")).softmax(-1)
    ref = torch.einsum("bhij,jbhd->ibhd", probs, vx)
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12)


def test_per_head_layouts_run_their_own_heads():
    """Two query heads of one kv head with different layouts: each head's blocks touch only
    its own rows of out and dq (a head's plan carries `heads`)."""
    n = NB * BLOCK
    layouts = [_layout(1), _layout(2)]
    plan = [b for h, lay in enumerate(layouts) for b in layout_blocks(lay, BLOCK, head=h)]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(n, 1, 2, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(n, 1, 1, D, generator=g, dtype=torch.float64) for _ in "kv")
    out = torch.zeros_like(q)
    lse = torch.full((1, 2, n), float("-inf"), dtype=torch.float64)
    kernels = Kernels(lse_kernels.CPU_FLASH, lse_kernels.CPU_FLASH)
    blocks.forward(q, k, v, out, lse, plan, kernels, MaskRules(), D**-0.5)
    for h, lay in enumerate(layouts):
        scores = torch.einsum("id,jd->ij", q[:, 0, h], k[:, 0, 0]) * D**-0.5
        probs = scores.masked_fill(_dense_mask(lay, True, None), float("-inf")).softmax(-1)
        torch.testing.assert_close(out[:, 0, h], probs @ v[:, 0, 0], rtol=1e-12, atol=1e-12)
