"""Rotary position embeddings (RoPE) with global position ids.

Non-interleaved ("rotate half") layout as in Megatron-LM, Llama and Hugging Face.

Precision: cos/sin are built in fp32 and the rotation is computed in fp32, then the result is
cast back to the dtype of x. Under --bf16/--fp16 q and k therefore leave RoPE in the activation
dtype like v, so FlashAttention-2 accepts them and the Ulysses all-to-all moves 2-byte
elements (an fp32 q or k would upcast the packed q|k|v buffer to fp32: twice the bytes).
"""

from __future__ import annotations

import torch


def rotary_cos_sin(
    position_ids: torch.Tensor, head_dim: int, base: float, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [s, b] -> cos, sin of shape [s, b, 1, head_dim] (broadcast over heads).
    Keep the fp32 default for training: apply_rotary computes in fp32 anyway."""
    inv_freq = 1.0 / (
        base
        ** (
            torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
        )
    )
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq  # [s, b, d/2]
    emb = torch.cat([angles, angles], dim=-1).unsqueeze(2)  # [s, b, 1, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [s, b, heads, head_dim] -> the rotated x, in x's dtype (computed in fp32)."""
    x32 = x.float()
    return (x32 * cos.float() + _rotate_half(x32) * sin.float()).to(x.dtype)
