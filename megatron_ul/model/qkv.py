"""q, k and v out of the fused QKV projection, each in a buffer of its own.

The fused output is laid out by query group, [s, b, groups, q_per_group + 2, d]. Indexing it
(`qkv[..., per_group]`) gives views: the attention kernel saving v would keep the whole fused
output alive for backward, and autograd's select/slice backward builds one zero-filled
fused-size buffer per piece and sums them. Here forward copies the three pieces out (nothing is
saved, so the fused output dies at once) and backward writes the three gradients into one
fused-size buffer, each into its own slots.
"""

from __future__ import annotations

import torch


class _SplitQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: torch.Tensor, per_group: int):
        s, b, groups, _, d = qkv.shape
        ctx.per_group = per_group
        q = qkv[:, :, :, :per_group].reshape(s, b, groups * per_group, d)
        k = qkv[:, :, :, per_group].contiguous()
        v = qkv[:, :, :, per_group + 1].contiguous()
        return q, k, v

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        s, b, groups, d = dk.shape
        per_group = ctx.per_group
        dqkv = dq.new_empty((s, b, groups, per_group + 2, d))
        dqkv[:, :, :, :per_group].copy_(dq.view(s, b, groups, per_group, d))
        dqkv[:, :, :, per_group].copy_(dk)
        dqkv[:, :, :, per_group + 1].copy_(dv)
        return dqkv, None


def split_qkv(qkv: torch.Tensor, per_group: int):
    """[s, b, groups, per_group + 2, d] -> q [s, b, groups·per_group, d], k, v [s, b, groups,
    d], three contiguous tensors; the gradient flows back into one fused-size buffer."""
    return _SplitQKV.apply(qkv, per_group)
