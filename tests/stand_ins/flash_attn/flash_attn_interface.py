"""Stand-in of `flash_attn.flash_attn_interface`'s forward and backward functions (the 2.7
signatures), which ring attention calls per unit with the merged log-sum-exp.

Real contracts kept (flash_attn_interface.py and csrc/flash_attn/flash_api.cpp, 2.7):
  _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                      window_size_right, softcap, alibi_slopes, return_softmax)
      -> (out, softmax_lse, S_dmask, rng_state); q [b, sq, h, d], k/v [b, sk, hk, d];
      softmax_lse fp32 [b, h, sq]; unlike the public functions nothing pads the head dim, so it
      must be a multiple of 8 (and <= 256).
  _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                       causal, window_size_left, window_size_right, softcap, alibi_slopes,
                       deterministic, rng_state=None) -> softmax_d [b, h, round_up(sq, 128)];
      writes the gradients into the caller's dq, dk, dv (shapes and dtypes of q, k, v, last
      dimension contiguous); out and dout of q's shape and dtype; softmax_lse fp32 [b, h, sq].
A row that sees no key has lse +inf in the real kernel (so that backward's exp(S - lse) is 0);
the stand-in returns the same.
"""

from __future__ import annotations

import torch

from . import _attend, _check_qkv, _check_window, _visible, calls

calls.update({"_flash_attn_forward": 0, "_flash_attn_backward": 0})


def _check_private(q, k, v):
    _check_qkv(q, k, v, rank=4)
    if q.shape[-1] % 8:
        raise RuntimeError(
            "query, key, value, and out_ must have a head_size that is a multiple "
            f"of 8 (got {q.shape[-1]})"
        )
    if k.shape[0] != q.shape[0]:
        raise RuntimeError("q, k and v must have the same batch size")


def _check_like(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.shape != like.shape or t.dtype != like.dtype:
        raise RuntimeError(
            f"{name} must have the shape and dtype of its input "
            f"({None if t is None else (tuple(t.shape), t.dtype)} vs "
            f"{(tuple(like.shape), like.dtype)})"
        )
    if t.device != like.device or t.stride(-1) != 1:
        raise RuntimeError(f"{name} must be on the input's device with a contiguous last dimension")


def _check_lse(lse: torch.Tensor, q: torch.Tensor) -> None:
    b, sq, h, _ = q.shape
    if lse.dtype != torch.float32 or tuple(lse.shape) != (b, h, sq) or not lse.is_contiguous():
        raise RuntimeError(
            f"softmax_lse must be a contiguous fp32 [batch, heads, seqlen_q] "
            f"tensor (got {tuple(lse.shape)} {lse.dtype})"
        )


def _softcap_and_alibi_off(softcap, alibi_slopes):
    if softcap != 0.0 or alibi_slopes is not None:
        raise NotImplementedError("the stand-in's private functions model no softcap / alibi")


def _flash_attn_forward(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    return_softmax,
):
    _check_private(q, k, v)
    window = _check_window((window_size_left, window_size_right))
    _softcap_and_alibi_off(softcap, alibi_slopes)
    if dropout_p != 0.0:
        raise NotImplementedError("the stand-in's private forward models no dropout")
    calls["_flash_attn_forward"] += 1
    out, lse = _attend(q, k, v, 0.0, softmax_scale, causal, window, 0.0, None)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # the kernel's empty rows
    s_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    return out, lse.contiguous(), s_dmask, torch.zeros(2, dtype=torch.int64, device=q.device)


def _flash_attn_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    del deterministic, rng_state
    _check_private(q, k, v)
    window = _check_window((window_size_left, window_size_right))
    _softcap_and_alibi_off(softcap, alibi_slopes)
    if dropout_p != 0.0:
        raise NotImplementedError("the stand-in's private backward models no dropout")
    for name, t, like in (
        ("dout", dout, q),
        ("out", out, q),
        ("dq", dq, q),
        ("dk", dk, k),
        ("dv", dv, v),
    ):
        _check_like(name, t, like)
    _check_lse(softmax_lse, q)
    calls["_flash_attn_backward"] += 1
    with torch.autocast(q.device.type, enabled=False):
        grads = _gradients(dout, q, k, v, out, softmax_lse, softmax_scale, causal, window)
    for target, grad in zip((dq, dk, dv), grads):
        target.copy_(grad)
    b, sq, h, _ = q.shape
    return torch.zeros(b, h, -(-sq // 128) * 128, dtype=torch.float32, device=q.device)


def _gradients(dout, q, k, v, out, lse, scale, causal, window):
    """FlashAttention's backward in fp32: P = exp(S - lse) with the given (final) lse."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = hq // hk
    qf, kf, vf, of, gf = (t.float().transpose(1, 2) for t in (q, k, v, out, dout))
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    scores = qf @ kf.transpose(-1, -2) * scale
    scores = scores.masked_fill(~_visible(sq, sk, causal, window, q.device), float("-inf"))
    p = torch.exp(scores - lse.unsqueeze(-1))
    delta = (gf * of).sum(-1, keepdim=True)
    dvf = p.transpose(-1, -2) @ gf
    ds = p * (gf @ vf.transpose(-1, -2) - delta)
    dqf = ds @ kf * scale
    dkf = ds.transpose(-1, -2) @ qf * scale
    dkf, dvf = (t.view(b, hk, group, sk, d).sum(2) for t in (dkf, dvf))
    return (dqf.transpose(1, 2), dkf.transpose(1, 2), dvf.transpose(1, 2))
