"""Dense causal attention on the full sequence for a slice of heads: FlashAttention-2's
flash_attn_func or torch SDPA pinned to the backend the selection named (backends.py). No
communication and no decision happens here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import sdpa_backend_pinned, sdpa_expands_kv
from .flash_attn import flash_attn_module


def require_one_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k and v must be in one dtype (the activation dtype): a mixed set means one of them
    was upcast (its all-to-all would move twice the bytes), and FlashAttention-2 refuses it."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share the activation dtype (got {q.dtype}, {k.dtype}, {v.dtype})"
        )


def _own_buffer_unless_shared_with(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`t`, or a compact copy when it is a view into a larger buffer that q does not keep alive
    anyway: with RoPE, q and k are new tensors while v is still a view of the fused QKV output,
    and the kernel saving that view would keep the whole QKV output for backward."""
    storage = t.untyped_storage()
    if (
        storage.data_ptr() == q.untyped_storage().data_ptr()
        or storage.nbytes() == t.numel() * t.element_size()
    ):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _sdpa_layout(t: torch.Tensor) -> torch.Tensor:
    """t [b, h, N, d] as SDPA's kernel runs it fastest. torch's CPU flash kernel runs half
    precision 1.6x faster (bf16, 4 heads, N = 2048, forward + backward) on inputs contiguous in
    this layout than on views of [N, b, h, d] (fp32: 6%, not worth the copy); CUDA's fused
    kernels take [b, N, h, d] rows natively, so the view stays."""
    if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16):
        return t.contiguous()
    return t


def expand_kv_for_sdpa(q, k, v, has_mask: bool, heads_dim: int = 2):
    """k, v repeated to q's heads where CUDA SDPA would otherwise run its math kernel (O(N²)
    memory) because of GQA alone: fp32 (no flash kernel) needs the efficient kernel, which
    takes equal head counts only (attention_dispatch.sdpa_cuda_backend)."""
    hq, hk = q.shape[heads_dim], k.shape[heads_dim]
    if not sdpa_expands_kv(q.device, q.dtype, q.shape[-1], hq, hk, has_mask):
        return k, v
    return (
        k.repeat_interleave(hq // hk, dim=heads_dim),
        v.repeat_interleave(hq // hk, dim=heads_dim),
    )


def flash_causal(q, k, v, *, dropout_p: float, softmax_scale: float | None) -> torch.Tensor:
    """flash_attn_func, causal. q [N, b, hq, d]; k, v [N, b, hk, d] -> [N, b, hq, d]."""
    k, v = _own_buffer_unless_shared_with(k, q), _own_buffer_unless_shared_with(v, q)
    # [N, b, h, d] -> [b, N, h, d]: a view whose last dimension stays contiguous.
    out = flash_attn_module().flash_attn_func(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=True,
    )
    return out.transpose(0, 1)


def sdpa_causal(
    q,
    k,
    v,
    *,
    backend: str | None,
    expand_kv: bool,
    dropout_p: float,
    softmax_scale: float | None,
) -> torch.Tensor:
    """torch SDPA, causal, pinned to `backend` ('cudnn', 'flash', 'efficient', 'math'; None:
    torch's own choice, the CPU). expand_kv: k, v repeated to q's heads first (the efficient
    kernel takes equal head counts only). q [N, b, hq, d]; k, v [N, b, hk, d] -> [N, b, hq, d]
    in q's dtype (the activation dtype: never upcast here)."""
    k, v = _own_buffer_unless_shared_with(k, q), _own_buffer_unless_shared_with(v, q)
    # GQA (query head i uses kv head i // (hq / hk)): SDPA's enable_gqa broadcasts the kv
    # heads inside the kernel instead of keeping k and v repeated hq/hk times for backward.
    # On torch 2.13 CPU the flash kernel takes it; 8 q / 2 kv heads, N=2048, d=64: saved
    # bytes 16.8 MB -> 10.6 MB, forward+backward time unchanged (0.59 s both).
    hq, hk = q.shape[2], k.shape[2]
    if expand_kv and hq != hk:
        k, v = k.repeat_interleave(hq // hk, dim=2), v.repeat_interleave(hq // hk, dim=2)
    gqa = k.shape[2] != hq
    # [N, b, h, d] -> [b, h, N, d]
    q_, k_, v_ = (_sdpa_layout(t.permute(1, 2, 0, 3)) for t in (q, k, v))
    # On CUDA torch runs the selected backend or refuses (dispatch.sdpa_backend_pinned).
    with sdpa_backend_pinned(backend):
        out = F.scaled_dot_product_attention(
            q_, k_, v_, dropout_p=dropout_p, is_causal=True, scale=softmax_scale, enable_gqa=gqa
        )
    return out.permute(2, 0, 1, 3)
