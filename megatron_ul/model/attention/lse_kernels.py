"""Fused attention kernels that return the log-sum-exp: the ring's unit kernel.

Every kernel computes one block of causal-or-full attention, q [b, hq, Sq, d] against k, v
[b, hk, Sk, d] (hq a multiple of hk), in the activation dtype, optionally with an additive
bias [b, 1, Sq, Sk] (0 = visible, -inf = masked) broadcast over the heads:

    forward(q, k, v, causal, bias, scale)  -> out [b, hq, Sq, d] (q's dtype), lse [b, hq, Sq]
    backward(dout, q, k, v, out, lse, causal, bias, scale) -> dq, dk, dv (the inputs' dtypes)

`lse` is fp32 (fp64 for fp64 inputs); a row that sees no key has lse -inf and out 0, so that it
merges as a no-op. backward takes the FINAL out and lse of the whole row (all units merged), as
FlashAttention's backward does: the probabilities of this block are exp(S - lse), so the
block's share of the gradient needs nothing else. `causal` is top-left aligned (Sq == Sk in
the ring's diagonal units).

Kernels (chosen by `backends.unit_kernel`, in the order of `backends.UNIT_KERNELS`):
  cpu-flash       torch's fused CPU flash kernel (any float dtype, GQA, bias)
  flash-attn      flash_attn's _flash_attn_forward/_backward (2.5-2.8; CUDA, fp16/bf16, no bias)
  sdpa-efficient  torch's memory-efficient kernel (CUDA, fp32/fp16/bf16, bias; GQA by
                  expanding k/v for the block, dk/dv summed back over the group). Its
                  backward reads `out` as [b, s, h, d] memory whatever its strides, so out
                  and dout are handed over in that layout. `efficient_attention` and its
                  backward also take attention dropout: the forward's philox seed and
                  offset go back to the backward, which redraws the same mask.
  reference       softmax written out in fp32 or wider (fp64 on CUDA, and tests)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .flash_attn import flash_attn_api

# Tests replace this with a CPU stand-in of the CUDA kernels' operator contracts.
cuda_ops = torch.ops.aten


@dataclass(frozen=True)
class UnitKernel:
    name: str
    takes_bias: bool
    forward: Callable
    backward: Callable


def _empty_rows_to_neg_inf(out, lse, bias):
    """A row that the bias masks entirely: out 0 and lse -inf (kernels disagree: 0, +inf)."""
    if bias is None:
        return out, lse
    sees = (bias != float("-inf")).any(-1)  # [b, 1, Sq]
    return (
        torch.where(sees.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype)),
        lse.masked_fill(~sees, float("-inf")),
    )


# ---- torch's CPU flash kernel ------------------------------------------------------------------
def _cpu_flash_forward(q, k, v, causal, bias, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scale
    )
    return _empty_rows_to_neg_inf(out, lse, bias)


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, bias, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout,
        q,
        k,
        v,
        out,
        lse.to(q.dtype if q.dtype == torch.float64 else torch.float32).contiguous(),
        0.0,
        causal,
        attn_mask=bias,
        scale=scale,
    )


CPU_FLASH = UnitKernel("cpu-flash", True, _cpu_flash_forward, _cpu_flash_backward)


# ---- flash-attn 2 --------------------------------------------------------------------------------
# The private functions changed their calling convention twice (flash_attn_interface.py):
#   2.5  _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size,
#            alibi_slopes, return_softmax) -> (out, q, k, v, out_padded, lse, S_dmask, rng)
#        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, softmax_scale,
#            causal, window_size, alibi_slopes, deterministic, rng_state) -> (dq, dk, dv, d)
#   2.6  as 2.5 with softcap after window_size
#   2.7+ torch custom ops (inspect.signature says only (*args, **kwargs)) taking
#        window_size_left, window_size_right where 2.6 takes window_size:
#        forward -> (out, lse, S_dmask, rng), backward -> softmax_d
# Every release writes the gradients into the dq, dk, dv it is given, so the backward reads
# them there. The convention comes from the installed release's version (flash_attn.py refuses
# releases outside 2.5-2.8 before any call).
def _flash_interface():
    return importlib.import_module("flash_attn.flash_attn_interface")


def _flash_release_api() -> str:
    return flash_attn_api(importlib.import_module("flash_attn"))


def _window_kwargs(api: str) -> dict:
    """The unbounded window (and softcap off) as the release spells them."""
    if api == "2.7":
        return {"window_size_left": -1, "window_size_right": -1, "softcap": 0.0}
    if api == "2.6":
        return {"window_size": (-1, -1), "softcap": 0.0}
    return {"window_size": (-1, -1)}


def _bshd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)  # [b, h, s, d] -> [b, s, h, d], last dimension still contiguous


def _flash_attn_forward(q, k, v, causal, bias, scale):
    assert bias is None, "flash-attn takes no bias"
    api = _flash_release_api()
    result = _flash_interface()._flash_attn_forward(
        _bshd(q),
        _bshd(k),
        _bshd(v),
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        alibi_slopes=None,
        return_softmax=False,
        **_window_kwargs(api),
    )
    out, lse = (result[0], result[1]) if api == "2.7" else (result[0], result[5])
    # the kernel gives rows without keys lse +inf; the merge needs -inf
    return out.transpose(1, 2), lse.masked_fill(lse == float("inf"), float("-inf"))


def _flash_attn_backward(dout, q, k, v, out, lse, causal, bias, scale):
    assert bias is None, "flash-attn takes no bias"
    dq, dk, dv = (torch.empty(_bshd(t).shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    _flash_interface()._flash_attn_backward(
        _bshd(dout).contiguous(),
        _bshd(q),
        _bshd(k),
        _bshd(v),
        _bshd(out).contiguous(),
        lse.float().contiguous(),
        dq,
        dk,
        dv,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
        **_window_kwargs(_flash_release_api()),
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


FLASH_ATTN = UnitKernel("flash-attn", False, _flash_attn_forward, _flash_attn_backward)


# ---- torch's memory-efficient CUDA kernel ------------------------------------------------------
LSE_ALIGN = 32  # the kernel pads its lse rows to a multiple of this
BIAS_ALIGN = 16  # ...and needs the bias rows' stride to be a multiple of this


@dataclass(frozen=True)
class Philox:
    """The philox seed and offset the efficient kernel's forward drew for its dropout mask
    (0-dim int64 host tensors, as the kernel returns them); its backward redraws the same
    mask from them."""

    seed: torch.Tensor
    offset: torch.Tensor


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _full_bias(bias, q):
    """[b or 1, 1, Sq, Sk] -> [b, hq, Sq, Sk] by strides only (the kernel takes no broadcast)."""
    return None if bias is None else bias.expand(q.shape[0], q.shape[1], *bias.shape[2:])


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] with [b, s, h, d] memory, the only layout in which the backward reads
    `out` right (its row stride is fixed to h·d; it takes only the batch and head strides).
    No copy when t is laid out so already (the forward's own output is)."""
    return (
        t if t.transpose(1, 2).is_contiguous() else t.transpose(1, 2).contiguous().transpose(1, 2)
    )


def efficient_attention(q, k, v, causal, bias, scale, dropout_p: float = 0.0):
    """The unit kernel's forward, with attention dropout: (out, lse, Philox or None). Dropout
    acts on the normalised probabilities; lse is that of the undropped scores, so partial
    results still merge exactly by their lse."""
    heads = q.shape[1]
    out, lse, seed, offset = cuda_ops._scaled_dot_product_efficient_attention(
        q,
        _expand_heads(k, heads),
        _expand_heads(v, heads),
        _full_bias(bias, q),
        True,
        dropout_p,
        causal,
        scale=scale,
    )
    out, lse = _empty_rows_to_neg_inf(out, lse[..., : q.shape[2]], bias)
    return out, lse, (Philox(seed, offset) if dropout_p > 0 else None)


def efficient_attention_backward(
    dout, q, k, v, out, lse, causal, bias, scale, dropout_p: float = 0.0, philox=None
):
    """Gradients of `efficient_attention`; with dropout, `philox` is what its forward drew."""
    b, heads, sq, d = q.shape
    padded = torch.zeros(
        b, heads, -(-sq // LSE_ALIGN) * LSE_ALIGN, dtype=torch.float32, device=q.device
    )
    padded[..., :sq] = lse
    if dropout_p > 0:
        if philox is None:
            raise ValueError("efficient attention backward with dropout needs the forward's Philox")
        seed, offset = philox.seed, philox.offset  # host tensors: the kernel reads them there
    else:
        seed = offset = torch.empty((), dtype=torch.int64)
    dq, dk, dv, _ = cuda_ops._scaled_dot_product_efficient_attention_backward(
        _kernel_layout(dout),
        q,
        _expand_heads(k, heads),
        _expand_heads(v, heads),
        _full_bias(bias, q),
        _kernel_layout(out),
        padded,
        seed,
        offset,
        dropout_p,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    group = heads // k.shape[1]
    if group > 1:
        dk, dv = (t.view(b, k.shape[1], group, *t.shape[2:]).sum(2) for t in (dk, dv))
    return dq, dk, dv


def _efficient_forward(q, k, v, causal, bias, scale):
    out, lse, _ = efficient_attention(q, k, v, causal, bias, scale)
    return out, lse


def _efficient_backward(dout, q, k, v, out, lse, causal, bias, scale):
    return efficient_attention_backward(dout, q, k, v, out, lse, causal, bias, scale)


SDPA_EFFICIENT = UnitKernel("sdpa-efficient", True, _efficient_forward, _efficient_backward)


# ---- reference: the softmax written out ----------------------------------------------------------
def _wide(dtype):
    return torch.promote_types(dtype, torch.float32)


def _reference_scores(q, k, causal, bias, scale):
    acc = _wide(q.dtype)
    s = torch.matmul(q.to(acc), _expand_heads(k, q.shape[1]).to(acc).transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(acc)
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(
            torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1), float("-inf")
        )
    return s


def _reference_forward(q, k, v, causal, bias, scale):
    s = _reference_scores(q, k, causal, bias, scale)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # empty rows: zeros
    out = torch.matmul(p, _expand_heads(v, q.shape[1]).to(p.dtype))
    return out.to(q.dtype), lse


def _reference_backward(dout, q, k, v, out, lse, causal, bias, scale):
    acc = _wide(q.dtype)
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    s = _reference_scores(q, k, causal, bias, scale)
    p = torch.exp(s - lse.to(acc).unsqueeze(-1))  # exactly 0 where masked
    dout_, kx, vx = dout.to(acc), _expand_heads(k, heads).to(acc), _expand_heads(v, heads).to(acc)
    delta = (dout_ * out.to(acc)).sum(-1, keepdim=True)
    dv = torch.matmul(p.transpose(-1, -2), dout_)
    ds = p * (torch.matmul(dout_, vx.transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, kx) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
    if group > 1:
        b, _, sk, d = dk.shape
        dk, dv = (t.view(b, k.shape[1], group, sk, d).sum(2) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


REFERENCE = UnitKernel("reference", True, _reference_forward, _reference_backward)

KERNELS = {kernel.name: kernel for kernel in (CPU_FLASH, FLASH_ATTN, SDPA_EFFICIENT, REFERENCE)}


def kernel_named(name: str) -> UnitKernel:
    return KERNELS[name]


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 activations."""
    return _wide(dtype)


__all__ = ["UnitKernel", "KERNELS", "kernel_named", "lse_dtype"]
