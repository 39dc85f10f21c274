"""Rotary position embeddings (RoPE) with global position ids.

Non-interleaved ("rotate half") layout as in Megatron-LM, Llama and Hugging Face: the two
halves of a head share one angle per pair, so the tables hold each angle once,
[s, b, 1, head_dim / 2], half the bytes of the repeated [s, b, 1, head_dim] tables.

Precision: cos/sin are built in fp32 and the rotation is computed in fp32, then the result is
cast back to the dtype of x. Under --bf16/--fp16 q and k therefore leave RoPE in the activation
dtype like v, so FlashAttention-2 accepts them and the Ulysses all-to-all moves 2-byte
elements (an fp32 q or k would upcast the packed q|k|v buffer to fp32: twice the bytes).
Megatron-core and Hugging Face round cos/sin to the activation dtype and rotate in it; that
would change q and k by a rounding, so the tables stay fp32. The fp32 rotation runs over
blocks of rows, forward and backward, so no fp32 copy of a whole q or k exists.
"""

from __future__ import annotations

import torch

# fp32 elements of one block's temporaries (x, its rotation and their products: ~4 copies)
ROTARY_BLOCK_ELEMENTS = 2**20


def rotary_cos_sin(
    position_ids: torch.Tensor, head_dim: int, base: float, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [s, b] -> cos, sin of shape [s, b, 1, head_dim / 2] (broadcast over heads;
    one angle for each pair of rotated halves). Keep the fp32 default for training:
    apply_rotary computes in fp32 anyway."""
    inv_freq = 1.0 / (
        base
        ** (
            torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
        )
    )
    angles = (position_ids.to(torch.float32).unsqueeze(-1) * inv_freq).unsqueeze(2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _row_blocks(x: torch.Tensor):
    rows = x.shape[0]
    per_row = max(1, x.numel() // max(rows, 1))
    step = max(1, ROTARY_BLOCK_ELEMENTS // per_row)
    for r in range(0, rows, step):
        yield slice(r, min(r + step, rows))


def _rotate_into(out, x, cos, sin, sign: float) -> None:
    """out[rows] = the rotation of x (sign 1) or its transpose (sign -1), block by block in
    fp32: [x1·c − x2·s, x2·c + x1·s] (the rotate-half form x·cos + rotate_half(x)·sin, the
    same products and sums elementwise), transposed [x1·c + x2·s, x2·c − x1·s]."""
    for rows in _row_blocks(x):
        x1, x2 = x[rows].float().chunk(2, dim=-1)
        c, s = cos[rows].float(), sin[rows].float()
        first, second = out[rows].chunk(2, dim=-1)
        if sign > 0:
            first.copy_(x1 * c - x2 * s)
            second.copy_(x2 * c + x1 * s)
        else:
            first.copy_(x1 * c + x2 * s)
            second.copy_(x2 * c - x1 * s)
        del x1, x2, c, s


class _Rotary(torch.autograd.Function):
    """Keeps only the tables (alive anyway for the layer's other calls); the gradient is the
    transposed rotation of the output's gradient."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        out = torch.empty_like(x)
        _rotate_into(out, x, cos, sin, 1.0)
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        grad_x = torch.empty_like(grad)
        _rotate_into(grad_x, grad, cos, sin, -1.0)
        return grad_x, None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [s, b, heads, head_dim] -> the rotated x, in x's dtype (computed in fp32); cos, sin
    from rotary_cos_sin (rows of them for rows of x)."""
    if cos.shape[-1] * 2 != x.shape[-1]:
        raise ValueError(
            f"RoPE tables of {cos.shape[-1]} angles do not rotate a head of {x.shape[-1]}"
        )
    return _Rotary.apply(x, cos, sin)
