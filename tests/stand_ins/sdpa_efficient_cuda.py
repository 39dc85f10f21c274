"""A strict CPU stand-in of torch's memory-efficient CUDA attention operators, for tests:

  aten::_scaled_dot_product_efficient_attention(query, key, value, attn_bias?,
      compute_log_sumexp, dropout_p=0., is_causal=False, *, scale=None)
      -> (output, log_sumexp, philox_seed, philox_offset)
  aten::_scaled_dot_product_efficient_attention_backward(grad_out_, query, key, value,
      attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p, grad_input_mask[4],
      is_causal=False, *, scale=None) -> (grad_query, grad_key, grad_value, grad_bias)

with the constraints of torch's kernel (sdp_utils.cpp, attention.cu, sm80+): fp32/fp16/bf16,
one dtype; [b, h, s, d] with equal head counts for q, k and v (no GQA); head dim divisible by
8 (half types) or 4 (fp32); last dimension contiguous; a bias of q's dtype, [b, h, sq, sk]
(broadcast strides allowed) whose row stride is a multiple of 16 elements; log_sumexp fp32
[b, h, sq rounded up to 32]; is_causal top-left aligned. Computed in fp32 with the softmax
written out. Install with `monkeypatch.setattr(lse_kernels, "cuda_ops", EfficientOps())`.
"""

from __future__ import annotations

import torch

HALF = (torch.float16, torch.bfloat16)


def _check(q, k, v, bias):
    if q.dtype not in (torch.float32, *HALF) or not (q.dtype == k.dtype == v.dtype):
        raise RuntimeError(f"efficient attention: unsupported dtypes {q.dtype} {k.dtype} {v.dtype}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise RuntimeError("efficient attention expects [batch, heads, seq, dim] inputs")
    if q.shape[1] != k.shape[1] or k.shape[1] != v.shape[1]:
        raise RuntimeError(
            "efficient attention requires equal numbers of query and key/value "
            f"heads (got {q.shape[1]}, {k.shape[1]}, {v.shape[1]})"
        )
    alignment = 8 if q.dtype in HALF else 4
    if q.shape[-1] % alignment or v.shape[-1] % alignment:
        raise RuntimeError(f"efficient attention requires head dims divisible by {alignment}")
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.stride(-1) != 1:
            raise RuntimeError(f"efficient attention: {name} needs a contiguous last dimension")
    if bias is not None:
        b, h, sq, _ = q.shape
        if bias.dtype != q.dtype or tuple(bias.shape) != (b, h, sq, k.shape[2]):
            raise RuntimeError(
                f"attn_bias must be {q.dtype} [b, h, sq, sk] (got {tuple(bias.shape)} {bias.dtype})"
            )
        if bias.stride(-1) != 1 or bias.stride(-2) % 16:
            raise RuntimeError(
                "attn_bias is not correctly aligned (strideM): its rows must "
                "start at multiples of 16 elements"
            )


def _scores(q, k, bias, causal, scale):
    s = q.float() @ k.float().transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.float()
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s


class EfficientOps:
    def __init__(self):
        self.calls = {"forward": 0, "backward": 0}

    def _scaled_dot_product_efficient_attention(
        self, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None
    ):
        _check(q, k, v, attn_bias)
        assert dropout_p == 0.0, "the stand-in models no dropout"
        self.calls["forward"] += 1
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        s = _scores(q, k, attn_bias, is_causal, scale)
        lse = torch.logsumexp(s, -1)
        out = (torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0) @ v.float()).to(q.dtype)
        b, h, sq, _ = q.shape
        padded = torch.zeros(b, h, -(-sq // 32) * 32 if compute_log_sumexp else 0)
        padded[..., :sq] = lse.masked_fill(lse == float("-inf"), float("inf"))
        seed = torch.zeros((), dtype=torch.int64)
        return out, padded, seed, seed

    def _scaled_dot_product_efficient_attention_backward(
        self,
        grad_out,
        q,
        k,
        v,
        attn_bias,
        out,
        logsumexp,
        philox_seed,
        philox_offset,
        dropout_p,
        grad_input_mask,
        is_causal=False,
        *,
        scale=None,
    ):
        _check(q, k, v, attn_bias)
        b, h, sq, _ = q.shape
        if logsumexp.dtype != torch.float32 or tuple(logsumexp.shape) != (b, h, -(-sq // 32) * 32):
            raise RuntimeError(
                f"logsumexp must be fp32 [b, h, sq rounded up to 32] (got {tuple(logsumexp.shape)})"
            )
        for name, t in (("grad_out", grad_out), ("out", out)):
            if t.shape != q.shape or t.dtype != q.dtype:
                raise RuntimeError(f"{name} must have query's shape and dtype")
        self.calls["backward"] += 1
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        s = _scores(q, k, attn_bias, is_causal, scale)
        p = torch.exp(s - logsumexp[..., :sq].unsqueeze(-1))
        g = grad_out.float()
        delta = (g * out.float()).sum(-1, keepdim=True)
        ds = p * (g @ v.float().transpose(-1, -2) - delta)
        dq = ds @ k.float() * scale
        dk = ds.transpose(-1, -2) @ q.float() * scale
        dv = p.transpose(-1, -2) @ g
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
