"""The strict CPU stand-in of flash_attn (tests/stand_ins/flash_attn) enforces the real
kernel's input contract and computes what FlashAttention-2 documents; and megatron_ul's local
attention sends a call to it only where the real kernel could run, logging which path ran."""

import logging
import math
from dataclasses import replace

import pytest
import torch

from megatron_ul.model.attention import backends, layer
from megatron_ul.model.attention import flash_attn as attention
from megatron_ul.model.attention.dispatch import H100, AttentionCall
from megatron_ul.model.rotary import apply_rotary, rotary_cos_sin
from megatron_ul.mpu.random import MODEL_PARALLEL_RNG, get_rng_tracker


def reference(q, k, v, causal=True, window=(-1, -1), scale=None):
    """Softmax attention written out in fp64, [b, s, h, d]; flash-attn's bottom-right causal
    alignment and window rule; rows that see no key are zero."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kv_of = torch.arange(hq) // (hq // hk)
    qd, kd, vd = q.double(), k.double()[:, :, kv_of], v.double()[:, :, kv_of]
    scores = torch.einsum("bihd,bjhd->bhij", qd, kd) * (scale or 1 / math.sqrt(d))
    left, right = window
    right = 0 if causal else right
    ok = torch.ones(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            diag = i + sk - sq
            if (right >= 0 and j > diag + right) or (left >= 0 and j < diag - left):
                ok[i, j] = False
    probs = scores.masked_fill(~ok, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", probs, vd)


def _qkv(b=2, sq=8, sk=8, hq=4, hk=2, d=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(b, s, h, d, generator=g).to(dtype) for s, h in ((sq, hq), (sk, hk), (sk, hk))
    ]


@pytest.mark.parametrize(
    "causal,window,sq,sk",
    [
        (True, (-1, -1), 8, 8),
        (False, (-1, -1), 8, 8),
        (True, (3, -1), 8, 8),
        (False, (2, 1), 8, 8),
        (True, (-1, -1), 4, 8),
        (True, (-1, -1), 8, 4),
    ],
)
def test_stand_in_matches_written_out_attention(flash_attn_stand_in, causal, window, sq, sk):
    q, k, v = _qkv(sq=sq, sk=sk)
    out = flash_attn_stand_in.flash_attn_func(q, k, v, causal=causal, window_size=window)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(
        out.double(), reference(q, k, v, causal, window), atol=1e-2, rtol=1e-2
    )
    if sq > sk and causal:  # bottom-right alignment: the first sq - sk queries see nothing
        assert out[:, : sq - sk].abs().max() == 0


def test_stand_in_varlen_equals_each_sequence_alone(flash_attn_stand_in):
    q, k, v = _qkv(b=1, sq=10, sk=10, dtype=torch.float16)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    out, lse, _ = flash_attn_stand_in.flash_attn_varlen_func(
        q[0], k[0], v[0], cu, cu, 7, 7, causal=True, return_attn_probs=True
    )
    # 2.5 pads lse to [batch, heads, max_seqlen_q]; 2.6+ packs it [heads, total_q]
    lse_shape = (2, 4, 7) if flash_attn_stand_in.API == "2.5" else (4, 10)
    assert out.shape == q[0].shape and lse.shape == lse_shape and lse.dtype == torch.float32
    for a, b in ((0, 3), (3, 10)):
        alone = flash_attn_stand_in.flash_attn_func(q[:, a:b], k[:, a:b], v[:, a:b], causal=True)
        torch.testing.assert_close(out[a:b], alone[0])


@pytest.mark.parametrize(
    "case,match",
    [
        ("fp32", "only support fp16 and bf16"),
        ("mixed", "same dtype"),
        ("heads", "must divide number of heads"),
        ("window", "window_size"),
        ("head_dim", "at most 256"),
    ],
)
def test_stand_in_refuses_what_the_kernel_refuses(flash_attn_stand_in, case, match):
    q, k, v = _qkv()
    if case == "fp32":
        q, k, v = q.float(), k.float(), v.float()
    elif case == "mixed":
        k = k.half()
    elif case == "heads":
        k, v = _qkv(hk=3)[1:]
    elif case == "window":
        with pytest.raises(RuntimeError, match=match):
            flash_attn_stand_in.flash_attn_func(q, k, v, window_size=(-2, 0))
        return
    elif case == "head_dim":
        q, k, v = _qkv(d=264)
    with pytest.raises(RuntimeError, match=match):
        flash_attn_stand_in.flash_attn_func(q, k, v)


def test_strided_last_dimension_is_copied_by_the_python_layer(flash_attn_stand_in):
    """Every release's Python wrapper makes q, k, v contiguous in their last dimension
    (maybe_contiguous) before the kernel, whose own check would refuse them."""
    q, k, v = _qkv()
    strided = torch.randn(2, 8, 4, 32).to(torch.bfloat16)[..., ::2]
    strided.copy_(q)
    assert strided.stride(-1) == 2
    torch.testing.assert_close(
        flash_attn_stand_in.flash_attn_func(strided, k, v, causal=True),
        flash_attn_stand_in.flash_attn_func(q, k, v, causal=True),
        atol=0,
        rtol=0,
    )


def test_stand_in_refuses_cpu_without_the_test_hook_and_bad_cu_seqlens(
    flash_attn_stand_in, monkeypatch
):
    q, k, v = _qkv(b=1)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    for bad, match in (
        (cu.long(), "int32"),
        (torch.tensor([0, 9], dtype=torch.int32), "end at the packed length"),
    ):
        with pytest.raises(RuntimeError, match=match):
            flash_attn_stand_in.flash_attn_varlen_func(q[0], k[0], v[0], bad, bad, 8, 8)
    with pytest.raises(RuntimeError, match="max_seqlen"):
        flash_attn_stand_in.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 4, 4)
    monkeypatch.delenv(attention.FLASH_ON_CPU_ENV)
    with pytest.raises(RuntimeError, match="only supports CUDA"):
        flash_attn_stand_in.flash_attn_func(q, k, v)


def test_rotary_returns_the_activation_dtype():
    x = torch.randn(6, 2, 4, 8).to(torch.bfloat16)
    cos, sin = rotary_cos_sin(torch.arange(6).unsqueeze(1).expand(6, 2), 8, 10000.0)
    assert cos.dtype == torch.float32
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = apply_rotary(x, cos, sin)
        assert out.dtype == torch.bfloat16
        cos_full, sin_full = (torch.cat([t, t], -1).double() for t in (cos, sin))  # per half
        expected = (
            x.double() * cos_full + torch.cat([-x[..., 4:], x[..., :4]], -1).double() * sin_full
        )
        torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


def _path_logged(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention:")]


@pytest.mark.parametrize(
    "dtype,expect_flash",
    [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False)],
)
def test_local_attention_uses_flash_only_where_it_can_run(
    flash_attn_stand_in, caplog, monkeypatch, dtype, expect_flash
):
    monkeypatch.setattr(backends, "_announced", set())
    get_rng_tracker().reset("cpu")
    get_rng_tracker().add(MODEL_PARALLEL_RNG, 0)
    q, k, v = (t.transpose(0, 1) for t in _qkv(dtype=dtype))  # [N, b, h, d]
    with caplog.at_level(logging.INFO, logger=backends.__name__):
        out = layer.local_attention(q, k, v, backend="flash", dropout_p=0.0)
    assert out.dtype == dtype and out.shape == q.shape
    assert (flash_attn_stand_in.calls["flash_attn_func"] == 1) == expect_flash
    logged = _path_logged(caplog)
    assert len(logged) == 1 and (("flash-attn" in logged[0].split("(")[0]) == expect_flash)
    torch.testing.assert_close(
        out.transpose(0, 1).double(),
        reference(*(t.transpose(0, 1) for t in (q, k, v))),
        atol=2e-2,
        rtol=2e-2,
    )


def test_without_flash_attn_installed_sdpa_is_selected_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(backends, "_announced", set())
    monkeypatch.setattr(attention, "flash_attn_module", lambda: None)
    asked = AttentionCall(torch.device("cuda"), torch.bfloat16, 64, 8, 8, gpu=H100)
    with caplog.at_level(logging.INFO, logger=backends.__name__):
        assert not backends.decide(replace(asked, use_flash_attn=True)).uses_flash_attn
        assert not backends.decide(replace(asked, use_flash_attn=False)).uses_flash_attn
    assert _path_logged(caplog) == [
        "attention: causal = sdpa cudnn (cuda sm90, cuDNN 91900; --use-flash-attn given, but "
        "flash-attn is not installed)",
        "attention: causal = sdpa cudnn (cuda sm90, cuDNN 91900)",
    ]


def test_mixed_qkv_dtypes_are_refused_before_any_kernel():
    q, k, v = (t.transpose(0, 1) for t in _qkv())
    with pytest.raises(TypeError, match="share the activation dtype"):
        layer.local_attention(q.float(), k, v, backend="sdpa", dropout_p=0.0)
