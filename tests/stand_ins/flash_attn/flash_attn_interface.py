"""Stand-in of `flash_attn.flash_attn_interface`, presenting the API of the release named by
`_release.VERSION` (read from flash_attn/flash_attn_interface.py at each tag):

private functions (what megatron_ul's ring calls per unit)
  v2.5.9.post1  plain functions; `window_size` is one (left, right) pair; no softcap:
      _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                          return_softmax)
          -> (out, q_padded, k_padded, v_padded, out_padded, softmax_lse, S_dmask, rng_state)
      _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                           softmax_scale, causal, window_size, alibi_slopes, deterministic,
                           rng_state=None) -> (dq, dk, dv, softmax_d)
      The kernel (`mha_fwd`) pads a head dim that is not a multiple of 8 itself and returns the
      padded tensors beside `out`; `mha_bwd` wants q, k, v, out padded (dout may be unpadded).
  v2.6.3  as 2.5, with `softcap` after `window_size` in both functions.
  v2.7.4.post1, v2.8.3  `torch.library.custom_op`s "flash_attn::_flash_attn_forward" and
      "flash_attn::_flash_attn_backward" (mutates dq, dk, dv), so `inspect.signature` of the
      module attribute is (*args, **kwargs); the schema is inferred from the annotations below,
      which are the release's own; `window_size_left` / `window_size_right` are two ints:
      _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                          window_size_right, softcap, alibi_slopes, return_softmax)
          -> (out, softmax_lse, S_dmask, rng_state)
      _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                           softmax_scale, causal, window_size_left, window_size_right, softcap,
                           alibi_slopes, deterministic, rng_state=None) -> softmax_d
      Nothing pads the head dim here: `mha_fwd` refuses one that is not a multiple of 8 (the
      public functions pad it in Python before the call).
  Every release: q [b, sq, h, d], k, v [b, sk, hk, d]; softmax_lse fp32 [b, h, sq]; S_dmask an
  empty tensor unless return_softmax (which needs dropout); rng_state int64 [2]; backward writes
  dq, dk, dv in place (shapes and dtype of q, k, v) and returns softmax_d fp32
  [b, h, round_up(sq, 128)].

public functions (`FlashAttnFunc`, `FlashAttnVarlenFunc`, `flash_attn_func`,
`flash_attn_varlen_func`)
  flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                  window_size=(-1, -1), [softcap=0.0 from 2.6,] alibi_slopes=None,
                  deterministic=False, return_attn_probs=False)
  flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                  [softcap=0.0 from 2.6,] alibi_slopes=None, deterministic=False,
                  return_attn_probs=False, block_table=None)
  return out, or (out, softmax_lse, S_dmask) with return_attn_probs. Varlen softmax_lse is
  [b, h, max_seqlen_q] in 2.5 and [h, total_q] from 2.6 (`mha_varlen_fwd`, unpadded_lse).
  flash_attn_func runs the release's private functions, as the real one does; the varlen
  function computes per sequence with the same arithmetic (the private varlen functions are not
  offered: megatron_ul does not call them).
"""

import torch

from . import _kernel as K
from ._release import API, VERSION

__version__ = VERSION

calls = {
    "flash_attn_func": 0,
    "flash_attn_varlen_func": 0,
    "_flash_attn_forward": 0,
    "_flash_attn_backward": 0,
}  # for tests: did the path run?


# ---- the kernels' entry points (flash_api.cpp), shared by every release ----------------------
def _mha_fwd(q, k, v, dropout_p, scale, causal, left, right, softcap, alibi, return_softmax):
    """`mha_fwd` -> (out, q_padded, k_padded, v_padded, out_padded, lse, p, rng_state); from 2.7
    the head dim must already be a multiple of 8 (then the padded tensors are the inputs). The
    private Python functions copy q, k, v whose last dimension is strided (maybe_contiguous)."""
    q, k, v = (_maybe_contiguous(t) for t in (q, k, v))
    for name, t in (("q", q), ("k", k), ("v", v)):
        K.check(t.dim() == 4, f"{name} must be [batch, seqlen, heads, head_dim]")
    K.check_qkv(q, k, v)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    K.check(b > 0, "batch size must be positive")
    K.check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    if API == "2.7":
        K.check(
            d % 8 == 0,
            "query, key, value, and out_ must have a head_size that is a multiple of 8",
        )
    K.check_heads(h, hk)
    K.check_dropout_softcap(dropout_p, softcap)
    K.check_shape("k", k, b, sk, hk, d)
    K.check_shape("v", v, b, sk, hk, d)
    K.check_alibi(alibi, b, h)
    if return_softmax:
        K.check(dropout_p > 0.0, "return_softmax is only supported when p_dropout > 0.0")
    left, right = K.kernel_window(*K.check_window(left, right), causal, sk)
    causal = left < 0 and right == 0  # set_params_fprop: what the kernel treats as causal
    seed, rng_state = K.seed_of(dropout_p, None)
    out, lse, p = K.forward(q, k, v, dropout_p, scale, (left, right), causal, softcap, alibi, seed)
    pad = K.round_multiple(d, 8) - d
    padded = [torch.nn.functional.pad(t, [0, pad]) if pad else t for t in (q, k, v, out)]
    s_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    if return_softmax:
        s_dmask = torch.zeros(
            (b, h, K.round_multiple(sq, 128), K.round_multiple(sk, 128)),
            dtype=q.dtype,
            device=q.device,
        )
        s_dmask[:, :, :sq, :sk] = p
    return (out, *padded[:3], padded[3], lse, s_dmask, rng_state.to(q.device))


def _mha_bwd(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dq,
    dk,
    dv,
    dropout_p,
    scale,
    causal,
    left,
    right,
    softcap,
    alibi,
    rng_state,
):
    """`mha_bwd` -> (dq, dk, dv, softmax_d); dq, dk, dv written in place when given (not copied
    by maybe_contiguous, unlike dout, q, k, v, out)."""
    dout, q, k, v, out = (_maybe_contiguous(t) for t in (dout, q, k, v, out))
    for name, t in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)):
        K.check(t.dim() == 4, f"{name} must be [batch, seqlen, heads, head_dim]")
    K.check_qkv(q, k, v)
    K.check(out.dtype == q.dtype, "query and out must have the same dtype")
    K.check(dout.dtype == q.dtype, "query and dout must have the same dtype")
    K.check_device(q, out, dout, lse)
    K.check(out.stride(-1) == 1, "out tensor must have contiguous last dimension")
    K.check(dout.stride(-1) == 1, "dout tensor must have contiguous last dimension")
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    K.check(b > 0, "batch size must be positive")
    K.check(d % 8 == 0, "head_size should be a multiple of 8")
    K.check(d <= 256, "FlashAttention backward only supports head dimension at most 256")
    K.check_heads(h, hk)
    K.check_dropout_softcap(dropout_p, softcap)
    K.check_alibi(alibi, b, h)
    for name, t, shape in (
        ("q", q, (b, sq, h, d)),
        ("k", k, (b, sk, hk, d)),
        ("v", v, (b, sk, hk, d)),
        ("out", out, (b, sq, h, d)),
    ):
        K.check_shape(name, t, *shape)
    if API == "2.7":
        K.check_shape("dout", dout, b, sq, h, d)
    else:  # the kernel pads dout itself
        d_og = dout.shape[3]
        K.check(
            d == K.round_multiple(d_og, 8),
            "head_size must be head_size_og rounded to a multiple of 8",
        )
        K.check_shape("dout", dout, b, sq, h, d_og)
        if d_og != d:
            dout = torch.nn.functional.pad(dout, [0, d - d_og])
    given = []
    for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if t is None:
            t = torch.empty_like(like)
        K.check_like(name, t, q, tuple(like.shape))
        given.append(t)
    left, right = K.kernel_window(*K.check_window(left, right), causal, sk)
    causal = left < 0 and right == 0  # set_params_fprop: what the kernel treats as causal
    seed, _ = K.seed_of(dropout_p, rng_state)
    lse = K.read_lse(lse, b, h, sq)
    *grads, delta = K.backward(
        dout, q, k, v, out, lse, dropout_p, scale, (left, right), causal, softcap, alibi, seed
    )
    for target, grad in zip(given, grads):
        target.copy_(grad)
    softmax_d = torch.zeros(b, h, K.round_multiple(sq, 128), dtype=torch.float32, device=q.device)
    softmax_d[..., :sq] = delta
    return (*given, softmax_d)


def _count(name):
    calls[name] += 1


# ---- the private functions, as each release defines them -------------------------------------
if API == "2.7":

    @torch.library.custom_op(
        "flash_attn::_flash_attn_forward", mutates_args=(), device_types=("cuda", "cpu")
    )
    def _flash_attn_forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: torch.Tensor | None,
        return_softmax: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        _count("_flash_attn_forward")
        out, *_, lse, s_dmask, rng_state = _mha_fwd(
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
        )
        return out, lse, s_dmask, rng_state

    @torch.library.register_fake("flash_attn::_flash_attn_forward")
    def _flash_attn_forward_fake(
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
        b, sq, h, _ = q.shape
        lse = q.new_empty((b, h, sq), dtype=torch.float32)
        p = q.new_empty((0,))
        if return_softmax:
            p = q.new_empty((b, h, K.round_multiple(sq, 128), K.round_multiple(k.shape[1], 128)))
        return torch.empty_like(q), lse, p, q.new_empty((2,), dtype=torch.int64)

    @torch.library.custom_op(
        "flash_attn::_flash_attn_backward",
        mutates_args=("dq", "dk", "dv"),
        device_types=("cuda", "cpu"),
    )
    def _flash_attn_backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        softmax_lse: torch.Tensor,
        dq: torch.Tensor | None,
        dk: torch.Tensor | None,
        dv: torch.Tensor | None,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: torch.Tensor | None,
        deterministic: bool,
        rng_state: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _count("_flash_attn_backward")
        *_, softmax_d = _mha_bwd(
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
            rng_state,
        )
        return softmax_d

    @torch.library.register_fake("flash_attn::_flash_attn_backward")
    def _flash_attn_backward_fake(
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
        b, sq, h, _ = q.shape
        return q.new_empty((b, h, K.round_multiple(sq, 128)), dtype=torch.float32)

    _wrapped_flash_attn_forward = torch.ops.flash_attn._flash_attn_forward
    _wrapped_flash_attn_backward = torch.ops.flash_attn._flash_attn_backward

elif API == "2.6":

    def _flash_attn_forward(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        return_softmax,
    ):
        _count("_flash_attn_forward")
        return _mha_fwd(
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal,
            window_size[0],
            window_size[1],
            softcap,
            alibi_slopes,
            return_softmax,
        )

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
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        _count("_flash_attn_backward")
        return _mha_bwd(
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
            window_size[0],
            window_size[1],
            softcap,
            alibi_slopes,
            rng_state,
        )

else:  # 2.5: no softcap

    def _flash_attn_forward(
        q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax
    ):
        _count("_flash_attn_forward")
        return _mha_fwd(
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal,
            window_size[0],
            window_size[1],
            0.0,
            alibi_slopes,
            return_softmax,
        )

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
        window_size,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        _count("_flash_attn_backward")
        return _mha_bwd(
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
            window_size[0],
            window_size[1],
            0.0,
            alibi_slopes,
            rng_state,
        )


def _private_forward(q, k, v, dropout_p, scale, causal, window_size, softcap, alibi, probs):
    """(out_padded, lse, S_dmask, rng_state) through this release's private forward."""
    if API == "2.7":
        return _wrapped_flash_attn_forward(
            q,
            k,
            v,
            dropout_p,
            scale,
            causal,
            window_size[0],
            window_size[1],
            softcap,
            alibi,
            probs,
        )
    extra = () if API == "2.5" else (softcap,)
    result = _flash_attn_forward(
        q, k, v, dropout_p, scale, causal, window_size, *extra, alibi, probs
    )
    out, q_pad, k_pad, v_pad, out_padded, lse, s_dmask, rng_state = result
    return out_padded, lse, s_dmask, rng_state, (q_pad, k_pad, v_pad)


def _private_backward(dout, saved, dq, dk, dv, ctx):
    q, k, v, out, lse, rng_state = saved
    if API == "2.7":
        _wrapped_flash_attn_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            dq,
            dk,
            dv,
            ctx.dropout_p,
            ctx.softmax_scale,
            ctx.causal,
            ctx.window_size[0],
            ctx.window_size[1],
            ctx.softcap,
            ctx.alibi_slopes,
            ctx.deterministic,
            rng_state=rng_state,
        )
        return
    extra = () if API == "2.5" else (ctx.softcap,)
    _flash_attn_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        dq,
        dk,
        dv,
        ctx.dropout_p,
        ctx.softmax_scale,
        ctx.causal,
        ctx.window_size,
        *extra,
        ctx.alibi_slopes,
        ctx.deterministic,
        rng_state=rng_state,
    )


# ---- public functions ---------------------------------------------------------------------------
class FlashAttnFunc(torch.autograd.Function):
    """FlashAttnFunc of the release: 2.7+ pads the head dim to a multiple of 8 in Python; 2.5
    and 2.6 leave it to the kernel, which returns the padded q, k, v for backward."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
    ):
        softmax_scale = K.default_scale(q, softmax_scale)
        d_og = q.shape[3]
        if API == "2.7" and d_og % 8:
            q, k, v = (torch.nn.functional.pad(t, [0, 8 - d_og % 8]) for t in (q, k, v))
        result = _private_forward(
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            return_softmax and dropout_p > 0,
        )
        out_padded, lse, s_dmask, rng_state = result[:4]
        if API != "2.7":
            q, k, v = result[4]
        ctx.save_for_backward(q, k, v, out_padded, lse, rng_state)
        ctx.dropout_p, ctx.softmax_scale, ctx.causal = dropout_p, softmax_scale, causal
        ctx.window_size, ctx.softcap, ctx.alibi_slopes = window_size, softcap, alibi_slopes
        ctx.deterministic = deterministic
        out = out_padded[..., :d_og]
        return out if not return_softmax else (out, lse, s_dmask)

    @staticmethod
    def backward(ctx, dout, *args):
        saved = ctx.saved_tensors
        q, k, v = saved[:3]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        d_og = dout.shape[3]
        if API == "2.7" and d_og % 8:
            dout = torch.nn.functional.pad(dout, [0, 8 - d_og % 8])
        _private_backward(_maybe_contiguous(dout), saved, dq, dk, dv, ctx)
        return (dq[..., :d_og], dk[..., :d_og], dv[..., :d_og]) + (None,) * 8


def _maybe_contiguous(t):
    """The release's maybe_contiguous: a copy only when the last dimension is strided."""
    return t.contiguous() if t.stride(-1) != 1 else t


def _flash_attn_func(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    return_attn_probs,
):
    calls["flash_attn_func"] += 1
    return FlashAttnFunc.apply(
        *(_maybe_contiguous(t) for t in (q, k, v)),
        dropout_p,
        softmax_scale,
        causal,
        tuple(window_size),
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


class FlashAttnVarlenFunc(torch.autograd.Function):
    """Per sequence, the arithmetic of `mha_varlen_fwd` / `mha_varlen_bwd`."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        return_softmax,
    ):
        scale = K.default_scale(q, softmax_scale)
        bq, bk = _varlen_bounds(q, k, v, cu_q, cu_k, max_q, max_k)
        K.check_dropout_softcap(dropout_p, softcap)
        K.check_alibi(alibi_slopes, len(bq) - 1, q.shape[1])
        left, right = K.kernel_window(*K.check_window(*window_size), causal, max_k)
        causal = left < 0 and right == 0  # set_params_fprop: what the kernel treats as causal
        seed, rng_state = K.seed_of(dropout_p, None)
        outs, lses, probs = [], [], []
        for i, (qkv, alibi) in enumerate(_sequences(bq, bk, q, k, v, alibi_slopes)):
            out, lse, p = K.forward(
                *qkv, dropout_p, scale, (left, right), causal, softcap, alibi, seed + i
            )
            outs.append(out[0])
            lses.append(lse[0])
            probs.append(p[0])
        out = torch.cat(outs)
        ctx.save_for_backward(q, k, v, out, rng_state)
        ctx.args = (bq, bk, dropout_p, scale, (left, right), causal, softcap, alibi_slopes, seed)
        ctx.lses = lses
        if not return_softmax:
            return out
        if API == "2.5":  # [b, h, max_seqlen_q]; rows past a sequence are never written
            lse = torch.zeros(len(lses), q.shape[1], max_q, dtype=torch.float32, device=q.device)
            for i, row in enumerate(lses):
                lse[i, :, : row.shape[-1]] = row
        else:
            lse = torch.cat(lses, dim=1)  # [h, total_q]
        s_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
        if dropout_p > 0:  # per sequence, padded to multiples of 128; dropped entries negated
            s_dmask = q.new_zeros(
                (len(probs), q.shape[1], K.round_multiple(max_q, 128), K.round_multiple(max_k, 128))
            )
            for i, p in enumerate(probs):
                s_dmask[i, :, : p.shape[-2], : p.shape[-1]] = p
        return out, lse, s_dmask

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, _ = ctx.saved_tensors
        bq, bk, dropout_p, scale, window, causal, softcap, alibi_slopes, seed = ctx.args
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        for i, (qkv, alibi) in enumerate(_sequences(bq, bk, q, k, v, alibi_slopes)):
            rows = slice(bq[i], bq[i + 1])
            cols = slice(bk[i], bk[i + 1])
            grads = K.backward(
                dout[rows].unsqueeze(0),
                *qkv,
                out[rows].unsqueeze(0),
                ctx.lses[i].unsqueeze(0),
                dropout_p,
                scale,
                window,
                causal,
                softcap,
                alibi,
                seed + i,
            )
            dq[rows], dk[cols], dv[cols] = (g[0] for g in grads[:3])
        return (dq, dk, dv) + (None,) * 11


def _varlen_bounds(q, k, v, cu_q, cu_k, max_q, max_k):
    for name, t in (("q", q), ("k", k), ("v", v)):
        K.check(t.dim() == 3, f"{name} must be [total, heads, head_dim]")
    K.check_qkv(q, k, v)
    d = q.shape[-1]
    K.check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    K.check_heads(q.shape[1], k.shape[1])
    K.check_shape("v", v, *k.shape)
    K.check(k.shape[-1] == d, "q, k and v must have the same head dimension")
    bq = _bounds("cu_seqlens_q", cu_q, q.shape[0], max_q, q.device)
    bk = _bounds("cu_seqlens_k", cu_k, k.shape[0], max_k, q.device)
    K.check(len(bq) == len(bk), "cu_seqlens_q and cu_seqlens_k must have batch_size + 1 entries")
    return bq, bk


def _bounds(name, cu, total, max_seqlen, device) -> list:
    """`mha_varlen_fwd` checks dtype, device, contiguity and shape; the stand-in also refuses
    offsets the kernel would read garbage through (not starting at 0, decreasing, not ending at
    the packed length, or a sequence longer than max_seqlen)."""
    K.check(
        isinstance(cu, torch.Tensor) and cu.dtype == torch.int32, f"{name} must have dtype int32"
    )
    K.check(cu.device == device, f"{name} must be on the device of q")
    K.check(cu.dim() == 1 and cu.numel() >= 2, f"{name} must have shape (batch_size + 1)")
    K.check(cu.is_contiguous(), f"{name} must be contiguous")
    bounds = cu.tolist()
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    K.check(
        bounds[0] == 0 and min(lengths) >= 0 and bounds[-1] == total,
        f"{name} must start at 0, not decrease and end at the packed length {total} (got {bounds})",
    )
    K.check(
        max(lengths) <= max_seqlen,
        f"max_seqlen {max_seqlen} is smaller than the longest sequence in {name} ({max(lengths)})",
    )
    return bounds


def _sequences(bq, bk, q, k, v, alibi_slopes):
    for i in range(len(bq) - 1):
        rows, cols = slice(bq[i], bq[i + 1]), slice(bk[i], bk[i + 1])
        alibi = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[i]
        yield (q[rows].unsqueeze(0), k[cols].unsqueeze(0), v[cols].unsqueeze(0)), alibi


def _flash_attn_varlen_func(
    q,
    k,
    v,
    cu_q,
    cu_k,
    max_q,
    max_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    return_attn_probs,
    block_table,
):
    if block_table is not None:
        raise NotImplementedError("the flash_attn stand-in does not model paged KV (block_table)")
    calls["flash_attn_varlen_func"] += 1
    return FlashAttnVarlenFunc.apply(
        *(_maybe_contiguous(t) for t in (q, k, v)),
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout_p,
        softmax_scale,
        causal,
        tuple(window_size),
        softcap,
        alibi_slopes,
        return_attn_probs,
    )


if API == "2.5":

    def flash_attn_func(
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
    ):
        """q [batch, seqlen_q, nheads, headdim], k, v [batch, seqlen_k, nheads_k, headdim]."""
        return _flash_attn_func(
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            0.0,
            alibi_slopes,
            deterministic,
            return_attn_probs,
        )

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        """q [total_q, nheads, headdim], k, v [total_k, nheads_k, headdim]."""
        return _flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            0.0,
            alibi_slopes,
            return_attn_probs,
            block_table,
        )

else:

    def flash_attn_func(
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
    ):
        """q [batch, seqlen_q, nheads, headdim], k, v [batch, seqlen_k, nheads_k, headdim]."""
        return _flash_attn_func(
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
        )

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        """q [total_q, nheads, headdim], k, v [total_k, nheads_k, headdim]."""
        return _flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            return_attn_probs,
            block_table,
        )
