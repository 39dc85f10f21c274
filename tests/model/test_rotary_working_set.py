"""RoPE against an fp64 complex-rotation reference, its tables holding each angle once and its
fp32 work done a block of rows at a time."""

from __future__ import annotations

import pytest
import torch

from megatron_ul.model import rotary
from tools.bench.live_tensors import LiveTensorTracker

S, B, HEADS, D = 96, 2, 3, 16


def _reference(x, positions, base=10000.0):
    """x rotated as complex numbers (x1 + i·x2)·exp(i·θ), in fp64. The angles are the fp32
    ones every RoPE implementation uses (position · inverse frequency rounded to fp32: off
    by up to 2e-4 rad at position 4096); what is checked here is the rotation."""
    inv_freq = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    theta = (positions.float().unsqueeze(-1) * inv_freq).double().unsqueeze(2)  # [s, b, 1, D/2]
    x1, x2 = x.double().chunk(2, dim=-1)
    z = torch.complex(x1, x2) * torch.polar(torch.ones_like(theta), theta)
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float64, 1e-6), (torch.float32, 1e-5), (torch.bfloat16, 2**-7)]
)
@pytest.mark.parametrize("block", [37, 2**20])
def test_rotation_and_its_gradient_match_fp64(monkeypatch, dtype, tol, block):
    monkeypatch.setattr(rotary, "ROTARY_BLOCK_ELEMENTS", block)
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 4096, (S, B), generator=g)
    x = torch.randn(S, B, HEADS, D, generator=g, dtype=torch.float64)
    w = torch.randn(S, B, HEADS, D, generator=g, dtype=torch.float64)
    cos, sin = rotary.rotary_cos_sin(positions, D, 10000.0)
    assert cos.shape == sin.shape == (S, B, 1, D // 2) and cos.dtype == torch.float32
    xd = x.to(dtype).requires_grad_()
    out = rotary.apply_rotary(xd, cos, sin)
    out.backward(w.to(dtype))
    assert out.dtype == dtype and xd.grad is not None and xd.grad.dtype == dtype
    ref_x = x.to(dtype).double().requires_grad_()
    want = _reference(ref_x, positions)
    (want_grad,) = torch.autograd.grad(want, ref_x, w.to(dtype).double())
    # the rotation is orthogonal: errors scale with |x| (≤ ~5 here)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=5 * tol)
    torch.testing.assert_close(xd.grad.double(), want_grad, rtol=0, atol=5 * tol)


def test_bf16_rotation_holds_one_block_of_fp32_rows(monkeypatch):
    """Forward and backward of a bf16 q: the output and the input's gradient (bf16) and one
    block of fp32 temporaries; the whole-tensor fp32 form held several fp32 copies of q."""
    n = 2048
    monkeypatch.setattr(rotary, "ROTARY_BLOCK_ELEMENTS", n * HEADS * D // 16)
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(n).unsqueeze(1)
    x = torch.randn(n, 1, HEADS, D, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(n, 1, HEADS, D, generator=g).to(torch.bfloat16)
    cos, sin = rotary.rotary_cos_sin(positions, D, 10000.0)
    unit = x.numel() * x.element_size()
    with LiveTensorTracker(preexisting=[x, w, cos, sin]) as tracker:
        tracker.phase = "rope"
        out = rotary.apply_rotary(x, cos, sin)
        out.backward(w)
        del out
    held = sum(t.numel() * t.element_size() for t in (x, w, cos, sin))
    above = (tracker.peaks["rope"].bytes - held) / unit
    # out (1) + x.grad (1) + fp32 temporaries of a 1/16 block (~1/3 unit); the whole-tensor
    # form's fp32 copy of x, its rotation and their products are over 4 units on their own
    assert above < 2.5, above
