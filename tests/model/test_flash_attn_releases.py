"""flash-attn 2.5, 2.6 and 2.7+ as megatron_ul meets them: the stand-in presents each release's
own private API (plain functions, then torch custom ops with the release's schemas), the ring's
unit kernel calls each one correctly (the calling convention chosen by version, since a custom
op's signature says only (*args, **kwargs)), the contract of rng_state under dropout holds,
and a release outside 2.5-2.8 is refused with a message naming it."""

import inspect
import json
import logging
import math
import os
from dataclasses import replace

import pytest
import torch

from megatron_ul.model.attention import backends, lse_kernels
from megatron_ul.model.attention import flash_attn as attention
from megatron_ul.model.attention.dispatch import H100, AttentionCall

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "flash_attn_schemas.json")


def _release(version):
    return pytest.mark.parametrize("flash_attn_stand_in", [version], indirect=True)


def _qkv(b=2, s=16, hq=4, hk=2, d=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g).to(dtype) for h in (hq, hk, hk)]


def _fp64_attention(q, k, v, causal=True, keep=None, dropout_p=0.0):
    """[b, s, h, d] softmax attention in fp64 with autograd (GQA by repeating k, v); `keep`
    [b, h, sq, sk] bool drops probabilities (kept ones scaled by 1 / (1 - p))."""
    hq, hk = q.shape[2], k.shape[2]
    kv_of = torch.arange(hq) // (hq // hk)
    scores = torch.einsum("bihd,bjhd->bhij", q, k[:, :, kv_of]) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    probs = scores.softmax(-1)
    if keep is not None:
        probs = probs * keep / (1 - dropout_p)
    return torch.einsum("bhij,bjhd->bihd", probs, v[:, :, kv_of]), torch.logsumexp(scores, -1)


def _interface():
    import flash_attn.flash_attn_interface as fi

    return fi


def _old_window_kwargs(fn) -> dict:
    """megatron_ul's former choice: a signature check, which a custom op defeats."""
    if "window_size_left" in inspect.signature(fn).parameters:
        return {"window_size_left": -1, "window_size_right": -1}
    return {"window_size": (-1, -1)}


def _old_forward(q, k, v):
    fi = _interface()
    return fi._flash_attn_forward(
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=0.25,
        causal=True,
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
        **_old_window_kwargs(fi._flash_attn_forward),
    )


@_release("2.7.4.post1")
def test_old_signature_check_fails_on_the_2_7_custom_op(flash_attn_stand_in):
    fi = _interface()
    assert str(inspect.signature(fi._flash_attn_forward)) == "(*args, **kwargs)"
    with pytest.raises(RuntimeError, match="missing value for argument 'window_size_left'"):
        _old_forward(*_qkv())
    q, k, v = (t.transpose(1, 2) for t in _qkv())  # [b, h, s, d]: the unit kernel's layout
    out, lse = lse_kernels.FLASH_ATTN.forward(q, k, v, True, None, 0.25)
    assert out.shape == q.shape and lse.shape == q.shape[:3]


@_release("2.5.9.post1")
def test_old_call_passes_softcap_that_2_5_does_not_take(flash_attn_stand_in):
    with pytest.raises(TypeError, match="softcap"):
        _old_forward(*_qkv())


def test_private_api_as_each_release_defines_it(flash_attn_stand_in):
    """Signatures, or for 2.7+ the registered schemas (recorded in tests/fixtures from the
    release's custom_op declarations); what forward returns and backward writes."""
    fi, api = _interface(), flash_attn_stand_in.API
    expected = json.load(open(FIXTURE))[api]
    forward, backward = fi._flash_attn_forward, fi._flash_attn_backward
    if api == "2.7":
        assert str(inspect.signature(forward)) == "(*args, **kwargs)"
        ops = torch.ops.flash_attn
        assert str(ops._flash_attn_forward.default._schema) == expected["_flash_attn_forward"]
        assert str(ops._flash_attn_backward.default._schema) == expected["_flash_attn_backward"]
    else:
        assert list(inspect.signature(forward).parameters) == expected["_flash_attn_forward"]
        assert list(inspect.signature(backward).parameters) == expected["_flash_attn_backward"]


@pytest.mark.parametrize("head_dim", [16, 12])
def test_private_functions_compute_attention_and_write_the_gradients(flash_attn_stand_in, head_dim):
    """fp64 reference; lse fp32 [b, h, sq]; head dim 12: 2.5/2.6's kernel pads it itself (and
    returns the padded q, k, v), 2.7+ refuses it (only the public functions pad there)."""
    fi, api = _interface(), flash_attn_stand_in.API
    q, k, v = _qkv(d=head_dim)
    window = (
        {"window_size_left": -1, "window_size_right": -1}
        if api == "2.7"
        else {"window_size": (-1, -1)}
    )
    extra = {} if api == "2.5" else {"softcap": 0.0}
    scale = 1 / math.sqrt(head_dim)
    common = dict(dropout_p=0.0, softmax_scale=scale, causal=True, alibi_slopes=None)
    if api == "2.7" and head_dim % 8:
        with pytest.raises(RuntimeError, match="multiple of 8"):
            fi._flash_attn_forward(q, k, v, return_softmax=False, **common, **window, **extra)
        return
    result = fi._flash_attn_forward(q, k, v, return_softmax=False, **common, **window, **extra)
    if api == "2.7":
        assert len(result) == 4
        out, lse, s_dmask, rng_state = result
        padded = (q, k, v, out)
    else:
        assert len(result) == 8
        out, *padded_qkv, out_padded, lse, s_dmask, rng_state = result
        padded = (*padded_qkv, out_padded)
        assert all(t.shape[-1] == 16 for t in padded)  # rounded up to a multiple of 8
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = _fp64_attention(*leaves)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 16) and s_dmask.numel() == 0
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,)
    torch.testing.assert_close(out.double(), ref.detach(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=1e-3, rtol=1e-3)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in padded[:3])
    returned = fi._flash_attn_backward(
        dout,
        *padded,
        lse,
        dq,
        dk,
        dv,
        deterministic=False,
        rng_state=None,
        **common,
        **window,
        **extra,
    )
    if api == "2.7":
        assert isinstance(returned, torch.Tensor) and returned.shape == (2, 4, 128)
    else:
        assert len(returned) == 4 and returned[0] is dq and returned[3].shape == (2, 4, 128)
    expected = torch.autograd.grad(ref, leaves, dout.double())
    for got, want in zip((dq, dk, dv), expected):
        torch.testing.assert_close(got[..., :head_dim].double(), want, atol=3e-2, rtol=3e-2)


def test_backward_needs_the_forwards_rng_state_under_dropout(flash_attn_stand_in):
    """Dropout: the public function's gradients (its backward hands the forward's rng_state
    to the private backward) equal fp64 autograd through the same dropped probabilities (the
    pattern read from S_dmask's signs); a private backward without rng_state drops others."""
    p = 0.3
    q, k, v = (t.requires_grad_() for t in _qkv(s=8))
    out, lse, s_dmask = flash_attn_stand_in.flash_attn_func(
        q, k, v, dropout_p=p, causal=False, return_attn_probs=True
    )
    assert s_dmask.shape == (2, 4, 128, 128)
    keep = s_dmask[:, :, :8, :8] >= 0  # non-causal: every probability is > 0
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = _fp64_attention(*leaves, causal=False, keep=keep.double(), dropout_p=p)
    torch.testing.assert_close(out.double(), ref.detach(), atol=2e-2, rtol=2e-2)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = torch.autograd.grad(ref, leaves, dout.double())
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)

    fi, api = _interface(), flash_attn_stand_in.API
    window = (
        {"window_size_left": -1, "window_size_right": -1}
        if api == "2.7"
        else {"window_size": (-1, -1)}
    )
    extra = {} if api == "2.5" else {"softcap": 0.0}
    dq = torch.empty_like(q)
    fi._flash_attn_backward(
        dout,
        q.detach(),
        k.detach(),
        v.detach(),
        out.detach(),
        lse,
        dq,
        torch.empty_like(k),
        torch.empty_like(v),
        dropout_p=p,
        softmax_scale=0.25,
        causal=False,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
        **window,
        **extra,
    )
    assert (dq.double() - expected[0]).abs().max() > 0.1  # another pattern: wrong gradients


@pytest.mark.parametrize("version", ["2.4.2", "3.0.0b1", None])
def test_unsupported_release_is_refused_once_naming_it(
    flash_attn_stand_in, monkeypatch, caplog, version
):
    monkeypatch.setattr(backends, "_announced", set())
    if version is None:
        monkeypatch.delattr(flash_attn_stand_in, "__version__")
    else:
        monkeypatch.setattr(flash_attn_stand_in, "__version__", version)
    why = attention.flash_attn_refusal(torch.device("cuda"), torch.bfloat16)
    assert why is not None and "megatron_ul runs flash-attn 2.5 to 2.8" in why
    assert (version or "of unknown version") in why
    call = AttentionCall(torch.device("cuda"), torch.bfloat16, 64, 8, 8, use_flash_attn=True)
    with caplog.at_level(logging.INFO, logger=backends.__name__):
        for _ in range(3):
            assert backends.decide(replace(call, gpu=H100)).name == "sdpa cudnn"
    logged = [r.getMessage() for r in caplog.records]
    assert logged == [
        f"attention: causal = sdpa cudnn (cuda sm90, cuDNN 91900; --use-flash-attn given, "
        f"but {why})"
    ]


def test_supported_releases_are_accepted(flash_attn_stand_in):
    assert attention.flash_attn_refusal(torch.device("cuda"), torch.bfloat16) is None
    assert attention.flash_attn_api(flash_attn_stand_in) == flash_attn_stand_in.API


def test_backward_reads_lse_through_the_kernels_addressing(flash_attn_stand_in):
    """mha_bwd checks only softmax_lse's device and reads it as contiguous fp32 [b, h, sq]:
    a transposed view gives other gradients (as on a GPU), a short one is refused; dq, dk, dv
    must have a contiguous last dimension (they are written in place, never copied)."""
    fi, api = _interface(), flash_attn_stand_in.API
    q, k, v = _qkv()
    window = (
        {"window_size_left": -1, "window_size_right": -1}
        if api == "2.7"
        else {"window_size": (-1, -1)}
    )
    extra = {} if api == "2.5" else {"softcap": 0.0}
    common = dict(dropout_p=0.0, softmax_scale=0.25, causal=True, alibi_slopes=None)
    result = fi._flash_attn_forward(q, k, v, return_softmax=False, **common, **window, **extra)
    out, lse = (result[0], result[1]) if api == "2.7" else (result[0], result[5])
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)

    def dq_with(lse_, dq=None):
        dq = torch.empty_like(q) if dq is None else dq
        fi._flash_attn_backward(
            dout,
            q,
            k,
            v,
            out,
            lse_,
            dq,
            torch.empty_like(k),
            torch.empty_like(v),
            deterministic=False,
            rng_state=None,
            **common,
            **window,
            **extra,
        )
        return dq

    right = dq_with(lse)
    strided = lse.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [b, sq, h] memory
    assert torch.equal(strided, lse) and not torch.equal(dq_with(strided), right)
    with pytest.raises(RuntimeError, match="read past"):
        dq_with(lse[:1].clone())
    with pytest.raises(RuntimeError, match="dq must have contiguous last dimension"):
        dq_with(lse, torch.empty(*q.shape[:3], 2 * q.shape[3], dtype=q.dtype)[..., ::2])


def test_varlen_dropout_drops_what_s_dmask_shows(flash_attn_stand_in):
    """Per sequence: output and gradients equal fp64 attention through the dropped
    probabilities that S_dmask reports ([b, h, 128, 128] per sequence, negative = dropped)."""
    p = 0.25
    q, k, v = (t[0].requires_grad_() for t in _qkv(b=1, s=10))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out, _, s_dmask = flash_attn_stand_in.flash_attn_varlen_func(
        q, k, v, cu, cu, 6, 6, dropout_p=p, return_attn_probs=True
    )
    assert s_dmask.shape == (2, 4, 128, 128)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for i, (a, b) in enumerate(((0, 4), (4, 10))):
        keep = (s_dmask[i : i + 1, :, : b - a, : b - a] >= 0).double()
        leaves = [t.detach()[a:b].unsqueeze(0).double().requires_grad_() for t in (q, k, v)]
        ref, _ = _fp64_attention(*leaves, causal=False, keep=keep, dropout_p=p)
        torch.testing.assert_close(out[a:b].double(), ref[0].detach(), atol=2e-2, rtol=2e-2)
        expected = torch.autograd.grad(ref, leaves, dout[a:b].unsqueeze(0).double())
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got[a:b].double(), want[0], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_and_softcap_as_the_kernel_applies_them(flash_attn_stand_in, causal):
    """ALiBi adds -slope * |i - j| (documented); the causal kernel adds slope * j instead
    (alibi.h), the same softmax with lse shifted by slope * i. softcap (2.6+):
    S = cap * tanh(S / cap) before the mask."""
    q, k, v = _qkv(s=8)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    softcap = {} if flash_attn_stand_in.API == "2.5" else {"softcap": 5.0}
    out, lse, _ = flash_attn_stand_in.flash_attn_func(
        q, k, v, causal=causal, alibi_slopes=slopes, return_attn_probs=True, **softcap
    )
    qd, kd, vd = q.double(), k.double()[:, :, [0, 0, 1, 1]], v.double()[:, :, [0, 0, 1, 1]]
    s = torch.einsum("bihd,bjhd->bhij", qd, kd) / 4
    if softcap:
        s = 5.0 * torch.tanh(s / 5.0)
    i, j = torch.arange(8.0).unsqueeze(1), torch.arange(8.0).unsqueeze(0)
    s = s - slopes.double().view(1, 4, 1, 1) * (i - j).abs()
    if causal:
        s = s.masked_fill(j > i, float("-inf"))
    ref = torch.einsum("bhij,bjhd->bihd", s.softmax(-1), vd)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    shift = slopes.double().view(1, 4, 1) * torch.arange(8.0) if causal else 0.0
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1) + shift, atol=1e-3, rtol=1e-3)
