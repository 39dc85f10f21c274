"""A strict CPU stand-in for the `flash_attn` package (FlashAttention-2, 2.6-style API), for tests.

It has the real `flash_attn_func` and `flash_attn_varlen_func` signatures and layouts and makes
the real kernel's input checks, so code that passes here passes them on a GPU too:

  - CUDA tensors only (the kernel has no CPU implementation). The one exception is the test hook
    of megatron_ul.model.attention: with the environment variable named by
    `FLASH_ON_CPU_ENV` set to 1, CPU tensors are accepted (and megatron_ul treats the CPU as a
    device where flash-attn can run), so the flash path runs in CPU tests;
  - fp16 or bf16 only, q, k and v of one dtype, contiguous last dimension, head dim <= 256,
    k and v of one shape, kv heads dividing query heads (GQA/MQA);
  - varlen: packed [total, heads, dim] tensors, int32 contiguous `cu_seqlens` of batch + 1
    entries starting at 0, non-decreasing, ending at the packed length, `max_seqlen` no smaller
    than the longest sequence (the kernel would read garbage; the stand-in refuses).

Semantics (as documented by flash-attn >= 2.1): `causal` aligns the mask to the bottom-right
corner when seqlen_q != seqlen_k; `window_size=(left, right)` lets query i see keys j with
i + sk - sq - left <= j <= i + sk - sq + right, -1 meaning unbounded, and causal forces right=0;
a query that sees no key gets a zero output. The computation is softmax attention written out
in fp32 with an explicit mask, outside autocast (the kernel is a custom op that autocast does
not touch); the output is cast back to the input dtype, as the kernel's fp32 accumulation is.

Not modelled: paged KV (`block_table` must be None), the kernel's exact dropout pattern (torch's
RNG draws the mask), and S_dmask (returned as None with return_attn_probs).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

__version__ = "2.6.3+cpu-stand-in"
IS_STAND_IN = True

# The name of megatron_ul's documented test hook (megatron_ul/model/attention.py); duplicated
# here rather than imported so that this module stays a drop-in for the real package.
FLASH_ON_CPU_ENV = "MEGATRON_UL_TEST_FLASH_ATTN_ON_CPU"

calls = {"flash_attn_func": 0, "flash_attn_varlen_func": 0}  # for tests: did the path run?


def _cpu_allowed() -> bool:
    return os.environ.get(FLASH_ON_CPU_ENV) == "1"


def _check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    if device.type != "cuda" and not (device.type == "cpu" and _cpu_allowed()):
        raise RuntimeError(
            "FlashAttention only supports CUDA tensors "
            f"(got {device}; CPU tests set {FLASH_ON_CPU_ENV}=1)"
        )
    for t in tensors[1:]:
        if t.device != device:
            raise RuntimeError(
                f"FlashAttention: all inputs must be on one device ({device} and {t.device})"
            )


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise RuntimeError(
                f"FlashAttention: {name} must have {rank} dimensions (got shape {tuple(t.shape)})"
            )
    _check_device(q, k, v)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"FlashAttention only support fp16 and bf16 data type (got {q.dtype})")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError(
            f"query and key/value must have the same dtype (q {q.dtype}, k {k.dtype}, v {v.dtype})"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise RuntimeError(f"Input tensor must have contiguous last dimension ({name})")
    if k.shape != v.shape:
        raise RuntimeError(
            f"k and v must have the same shape ({tuple(k.shape)} vs {tuple(v.shape)})"
        )
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise RuntimeError("q, k and v must have the same head dimension")
    if head_dim > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    hq, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or hq % hk != 0:
        raise RuntimeError(
            "Number of heads in key/value must divide number of heads in query "
            f"({hk} kv heads, {hq} query heads)"
        )


def _check_window(window_size) -> tuple[int, int]:
    if len(window_size) != 2 or any(int(w) != w or w < -1 for w in window_size):
        raise RuntimeError(f"window_size must be a pair of ints >= -1 (got {window_size})")
    return int(window_size[0]), int(window_size[1])


def _visible(sq: int, sk: int, causal: bool, window: tuple[int, int], device) -> torch.Tensor:
    """[sq, sk] bool, True where query i may attend to key j (bottom-right aligned)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    return ok


def _attend(q, k, v, dropout_p, scale, causal, window, softcap, alibi_slopes):
    """One sequence batch: q [b, sq, hq, d], k, v [b, sk, hk, d] -> (out, lse [b, hq, sq])."""
    with torch.autocast(q.device.type, enabled=False):
        return _attend_fp32(q, k, v, dropout_p, scale, causal, window, softcap, alibi_slopes)


def _attend_fp32(q, k, v, dropout_p, scale, causal, window, softcap, alibi_slopes):
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    kf, vf = kf.repeat_interleave(hq // hk, 1), vf.repeat_interleave(hq // hk, 1)
    scores = qf @ kf.transpose(-1, -2) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        i = torch.arange(sq, device=q.device).unsqueeze(1) + (sk - sq)
        j = torch.arange(sk, device=q.device).unsqueeze(0)
        slopes = alibi_slopes.float().reshape(-1 if alibi_slopes.dim() == 1 else b, hq)
        scores = scores - slopes.reshape(slopes.shape[0], hq, 1, 1) * (i - j).abs()
    visible = _visible(sq, sk, causal, window, q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf on empty rows
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # empty rows: zeros
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p, training=True)
    out = (probs @ vf).transpose(1, 2).to(q.dtype)
    return out, lse


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
    del deterministic  # the stand-in is deterministic whenever dropout is off
    _check_qkv(q, k, v, rank=4)
    if k.shape[0] != q.shape[0]:
        raise RuntimeError("q, k and v must have the same batch size")
    window = _check_window(window_size)
    calls["flash_attn_func"] += 1
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = _attend(q, k, v, dropout_p, scale, causal, window, softcap, alibi_slopes)
    return (out, lse, None) if return_attn_probs else out


def _check_cu_seqlens(
    name: str, cu: torch.Tensor, total: int, max_seqlen: int, device
) -> list[int]:
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32:
        raise RuntimeError(f"{name} must have dtype int32")
    if cu.device != device:
        raise RuntimeError(f"{name} must be on the device of q ({cu.device} vs {device})")
    if cu.dim() != 1 or not cu.is_contiguous() or cu.numel() < 2:
        raise RuntimeError(f"{name} must be a contiguous 1-D tensor of batch_size + 1 entries")
    bounds = cu.tolist()
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    if bounds[0] != 0 or min(lengths) < 0 or bounds[-1] != total:
        raise RuntimeError(
            f"{name} must start at 0, not decrease and end at the packed length "
            f"{total} (got {bounds})"
        )
    if max(lengths) > max_seqlen:
        raise RuntimeError(
            f"max_seqlen {max_seqlen} is smaller than the longest sequence in "
            f"{name} ({max(lengths)})"
        )
    return bounds


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
    """q [total_q, nheads, headdim], k, v [total_k, nheads_k, headdim]; sequence i is rows
    cu_seqlens[i]:cu_seqlens[i + 1]."""
    del deterministic
    if block_table is not None:
        raise NotImplementedError("the flash_attn stand-in does not model paged KV (block_table)")
    _check_qkv(q, k, v, rank=3)
    window = _check_window(window_size)
    bq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, q.device)
    bk = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, q.device)
    if len(bq) != len(bk):
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must have the same batch size")
    calls["flash_attn_varlen_func"] += 1
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    outs, lses = [], []
    for i in range(len(bq) - 1):
        slopes = (
            alibi_slopes
            if alibi_slopes is None or alibi_slopes.dim() == 1
            else alibi_slopes[i : i + 1]
        )
        out, lse = _attend(
            q[bq[i] : bq[i + 1]].unsqueeze(0),
            k[bk[i] : bk[i + 1]].unsqueeze(0),
            v[bk[i] : bk[i + 1]].unsqueeze(0),
            dropout_p,
            scale,
            causal,
            window,
            softcap,
            slopes,
        )
        outs.append(out.squeeze(0))
        lses.append(lse.squeeze(0))  # [h, s_i]
    out, lse = torch.cat(outs, dim=0), torch.cat(lses, dim=1)  # lse [h, total_q]
    return (out, lse, None) if return_attn_probs else out


__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
