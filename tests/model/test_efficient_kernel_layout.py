"""torch's memory-efficient CUDA kernel as lse_kernels calls it, on its stand-in
(tests/stand_ins/sdpa_efficient_cuda.py, the rules read from torch's CUDA sources).

The backward reads `out` with a row stride fixed to h·d and, in fp16/bf16, computes
delta = rowsum(dout · out) itself from that addressing: the old call (out.contiguous(), i.e.
[b, h, s, d] memory) gives wrong dq and dk with more than one head, the call in the kernel's
[b, s, h, d] layout is exact to the dtype's rounding against fp64. fp32 (delta by torch ops)
is right either way. Then every rule the stand-in enforces refuses a call that breaks it, and
dropout: the backward redraws the forward's mask from the philox seed and offset it is given.
"""

import math

import pytest
import torch

from megatron_ul.model.attention import lse_kernels
from tests.stand_ins.sdpa_efficient_cuda import EfficientOps, keep_scale

B, H, S, D = 2, 4, 40, 8
SCALE = 1 / math.sqrt(D)
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


@pytest.fixture
def ops(monkeypatch):
    stand_in = EfficientOps()
    monkeypatch.setattr(lse_kernels, "cuda_ops", stand_in)
    return stand_in


def _inputs(dtype, heads=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, heads, S, D, generator=g).to(dtype) for _ in range(4))
    return q, k, v, dout


def _fp64_grads(q, k, v, dout, causal, keep=None):
    """dq, dk, dv of causal softmax attention in fp64 (dropout: out = (P * keep) @ v)."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    s = leaves[0] @ leaves[1].transpose(-1, -2) * SCALE
    if causal:
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    if keep is not None:
        p = p * keep.double()
    out = p @ leaves[2]
    return out.detach(), torch.autograd.grad(out, leaves, dout.double())


def _relative_error(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def _old_backward(dout, q, k, v, out, lse, causal):
    """The call before the fix: out and dout handed over as out.contiguous()."""
    padded = torch.zeros(B, H, 64)
    padded[..., :S] = lse
    no_rng = torch.empty((), dtype=torch.int64)
    dq, dk, dv, _ = lse_kernels.cuda_ops._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(),
        q,
        k,
        v,
        None,
        out.contiguous(),
        padded,
        no_rng,
        no_rng,
        0.0,
        [True, True, True, False],
        causal,
        scale=SCALE,
    )
    return dq, dk, dv


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_old_out_layout_wrong_in_half_precision_new_call_exact(dtype, ops):
    q, k, v, dout = _inputs(dtype)
    out, lse = lse_kernels.SDPA_EFFICIENT.forward(q, k, v, True, None, SCALE)
    ref_out, ref_grads = _fp64_grads(q, k, v, dout, True)
    torch.testing.assert_close(out.double(), ref_out, **TOL[dtype])

    # merged outputs reach the backward in any layout: the new call must not depend on it
    for given in (out, out.contiguous()):
        grads = lse_kernels.SDPA_EFFICIENT.backward(dout, q, k, v, given, lse, True, None, SCALE)
        for got, want in zip(grads, ref_grads):
            assert got.dtype == dtype
            torch.testing.assert_close(got.double(), want, **TOL[dtype])

    old = _old_backward(dout, q, k, v, out, lse, True)
    if dtype == torch.float32:  # delta by torch ops on the real tensor: layout harmless
        for got, want in zip(old, ref_grads):
            torch.testing.assert_close(got.double(), want, **TOL[dtype])
        return
    # rows of other heads and memory past out's end: dq and dk wrong, dv (no delta) right
    for got, want in zip(old[:2], ref_grads[:2]):
        finite = torch.isfinite(got).all(-1)
        assert not finite.all()  # the kernel read past the buffer
        assert _relative_error(got[finite], want[finite]) > 0.1
    torch.testing.assert_close(old[2].double(), ref_grads[2], **TOL[dtype])


def test_kernel_layout_copies_only_when_needed():
    bshd = torch.randn(B, S, H, D).transpose(1, 2)
    assert lse_kernels._kernel_layout(bshd) is bshd
    bhsd = bshd.contiguous()
    moved = lse_kernels._kernel_layout(bhsd)
    assert moved.transpose(1, 2).is_contiguous() and torch.equal(moved, bhsd)


# ---- every enforced rule refuses a call that breaks it ------------------------------------------
def _forward(ops, q, k, v, bias=None, dropout_p=0.0):
    return ops._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p, False)


def _backward(ops, q, k, v, out, lse, bias=None, dropout_p=0.0, seed=None, offset=None):
    seed = torch.tensor(0, dtype=torch.int64) if seed is None else seed
    offset = torch.tensor(0, dtype=torch.int64) if offset is None else offset
    return ops._scaled_dot_product_efficient_attention_backward(
        out, q, k, v, bias, out, lse, seed, offset, dropout_p, [True] * 3 + [False], False
    )


def _valid(dtype=torch.bfloat16):
    q, k, v, _ = _inputs(dtype)
    ops = EfficientOps()
    out, lse, *_ = _forward(ops, q, k, v)
    return ops, q, k, v, out, lse


def test_valid_calls_pass_the_checks():
    ops, q, k, v, out, lse = _valid()
    bias = torch.zeros(B, 1, S, 48, dtype=q.dtype)[..., :S].expand(B, H, S, S)
    _forward(ops, q, k, v, bias)
    _backward(ops, q, k, v, out, lse, bias)
    assert ops.calls == {"forward": 2, "backward": 1}


@pytest.mark.parametrize(
    "breaks,match",
    [
        ("gqa", "no GQA"),
        ("dtype mix", "share a dtype"),
        ("fp64", "Only fp32, half & bf16"),
        ("bias dtype", "invalid dtype for bias"),
        ("bias rows", r"attn_bias is not correctly aligned \(strideM\)"),
        ("bias broadcast", "attn_bias does not broadcast"),
        ("head dim", r"query is not correctly aligned \(strideM\)"),
        ("last dim", "last dimension must be contiguous"),
    ],
)
def test_forward_rules(breaks, match):
    ops, q, k, v, _, _ = _valid()
    bias = None
    if breaks == "gqa":
        k, v = k[:, :2], v[:, :2]
    elif breaks == "dtype mix":
        k = k.half()
    elif breaks == "fp64":
        q, k, v = q.double(), k.double(), v.double()
    elif breaks == "bias dtype":
        bias = torch.zeros(B, 1, S, S, dtype=torch.float32)
    elif breaks == "bias rows":  # rows of 40 + 2 elements: not a multiple of 8 in bf16
        bias = torch.zeros(B, 1, S, S + 2, dtype=q.dtype)[..., :S]
    elif breaks == "bias broadcast":
        bias = torch.zeros(B, 1, S - 1, S, dtype=q.dtype)
    elif breaks == "head dim":  # d = 6: rows of q/k start every 6 elements
        q, k, v = (torch.randn(B, H, S, 6).to(q.dtype) for _ in range(3))
    elif breaks == "last dim":
        q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    with pytest.raises(RuntimeError, match=match):
        _forward(ops, q, k, v, bias)


@pytest.mark.parametrize(
    "breaks,match",
    [
        ("gqa", "no GQA"),
        ("lse dtype", "read as float"),
        ("lse unpadded", r"LSE is not correctly aligned \(strideH\)"),
        ("bias broadcast", "attn_bias: wrong shape"),
        ("bias rows", r"attn_bias is not correctly aligned \(strideM\)"),
        ("out dtype", "out must have query's dtype"),
        ("seed dtype", "philox_seed must be a one-element int64 CPU tensor"),
    ],
)
def test_backward_rules(breaks, match):
    ops, q, k, v, out, lse = _valid()
    bias, dropout_p, seed = None, 0.0, None
    if breaks == "gqa":
        k, v = k[:, :2], v[:, :2]
    elif breaks == "lse dtype":
        lse = lse.double()
    elif breaks == "lse unpadded":  # [b, h, 40]: head stride 40 is a multiple of 8; 41 is not
        lse = torch.cat([lse[..., :S], lse[..., :1]], -1).contiguous()
    elif breaks == "bias broadcast":
        bias = torch.zeros(B, 1, S, S, dtype=q.dtype)
    elif breaks == "bias rows":
        bias = torch.zeros(B, 1, S, S + 2, dtype=q.dtype)[..., :S].expand(B, H, S, S)
    elif breaks == "out dtype":
        out = out.float()
    elif breaks == "seed dtype":
        dropout_p, seed = 0.1, torch.tensor(0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=match):
        _backward(ops, q, k, v, out, lse, bias, dropout_p, seed)


def test_lse_is_read_at_unit_stride_along_the_queries(ops):
    """An lse view with another query stride is read as the kernel reads it: wrong rows."""
    q, k, v, dout = _inputs(torch.float32)
    out, lse = lse_kernels.SDPA_EFFICIENT.forward(q, k, v, True, None, SCALE)
    _, ref_grads = _fp64_grads(q, k, v, dout, True)
    padded = torch.zeros(B, H, 64)
    padded[..., :S] = lse
    spread = torch.zeros(B, H, 64, 2)
    spread[..., 0] = padded
    for given, right in ((padded, True), (spread[..., 0], False)):  # query stride 1 vs 2
        no_rng = torch.empty((), dtype=torch.int64)
        dq, *_ = ops._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, given, no_rng, no_rng, 0.0, [True] * 4, True, scale=SCALE
        )
        assert torch.allclose(dq.double(), ref_grads[0], atol=1e-4) == right


# ---- dropout -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_backward_redraws_the_forward_mask_from_its_seed_and_offset(dtype, ops):
    q, k, v, dout = _inputs(dtype)
    p = 0.25
    torch.manual_seed(5)
    out, lse, philox = lse_kernels.efficient_attention(q, k, v, True, None, SCALE, p)
    assert philox is not None and philox.seed.device.type == "cpu"
    assert philox.seed.dtype == torch.int64 and philox.seed.dim() == 0
    ((seed, offset, shape, _),) = ops.philox
    keep = keep_scale(seed, offset, shape, p)
    assert 0.6 < (keep > 0).float().mean() < 0.9  # about 1 - p kept
    ref_out, ref_grads = _fp64_grads(q, k, v, dout, True, keep)
    torch.testing.assert_close(out.double(), ref_out, **TOL[dtype])

    args = (dout, q, k, v, out, lse, True, None, SCALE, p)
    grads = lse_kernels.efficient_attention_backward(*args, philox)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, **TOL[dtype])
    # another offset is another mask: the gradients of an attention that did not run
    shifted = lse_kernels.Philox(philox.seed, philox.offset + 4)
    wrong = lse_kernels.efficient_attention_backward(*args, shifted)
    assert _relative_error(wrong[2], ref_grads[2]) > 0.1
    with pytest.raises(ValueError, match="needs the forward's Philox"):
        lse_kernels.efficient_attention_backward(*args, None)


def test_dropout_seed_and_offset_follow_the_generator(ops):
    q, k, v, _ = _inputs(torch.float32)
    torch.manual_seed(1)
    first = lse_kernels.efficient_attention(q, k, v, True, None, SCALE, 0.1)
    second = lse_kernels.efficient_attention(q, k, v, True, None, SCALE, 0.1)
    torch.manual_seed(1)
    replay = lse_kernels.efficient_attention(q, k, v, True, None, SCALE, 0.1)
    assert torch.equal(first[0], replay[0]) and not torch.equal(first[0], second[0])
