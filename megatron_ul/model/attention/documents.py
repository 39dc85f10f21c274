"""Causal attention within documents and/or a sliding window, in memory linear in N.

Packed pretraining samples hold several documents; with --reset-attention-mask a token sees
only earlier tokens of its own document (Megatron's EOD rule). The documents of a micro-batch
are described by `cu_seqlens`: int32 offsets of every document start over the flattened batch
[b·N] (so every sample start is one), plus b·N at the end — flash-attn's varlen format. It is
O(N); no [N, N] mask is built anywhere. The offsets are those of the full sequence: every
Ulysses rank computes them from the full sample (data/batches.py), and attention runs after the
all-to-all on the full sequence.

--window-size LEFT,0 (Megatron-core's window_size): token i sees keys i-LEFT .. i of its own
document.

Kernels (backends.py selects among them and the tiles, document_tiles.py):
  flash-attn (where flash_attn.flash_attn_refusal allows the call: CUDA, fp16/bf16, flash-attn
    importable): flash_attn_varlen_func with cu_seqlens (documents) or flash_attn_func (window
    only), window_size=(LEFT, 0), q/k/v packed [b·N, h, d].
  document blocks (CPU, and every other fallback): an autograd Function that runs SDPA per
    document (is_causal, the fused kernel keeps O(L) per document) or, with a window, per
    block of queries against the keys the window can reach; backward recomputes block by
    block and adds into dq/dk/dv. Memory is O(N·h·d) plus one block's scores, never O(N²).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ...mpu.random import device_rng_get, device_rng_set
from . import blocks as engine
from .blocks import Block, Mask
from .flash_attn import flash_attn_module
from .local import expand_kv_for_sdpa
from .lse_kernels import CPU_FLASH

# queries per block on the windowed SDPA path (its scores: block × (block + LEFT))
WINDOW_QUERY_BLOCK = 512
# tokens per tile of a document's in-place backward (its gradients: three tiles at a time)
DOCUMENT_GRAD_TILE = 1024


@dataclass
class DocumentMask:
    """The documents of one micro-batch: cu_seqlens [docs + 1] int32 over [b·N], N the full
    sequence length, on the device, and `host_offsets`, the same offsets on the host.

    The block loops, the ring's document starts and flash-attn's max_seqlen need the offsets
    as Python ints; reading them from the device tensor would stop the host until the device
    caught up, once per micro-batch. So the data path hands them over from where it computed
    them on the host (data/batches.py). Without them the offsets are read from `cu_seqlens`,
    free when it is host memory (tests, tools); on a GPU that read is a synchronisation."""

    cu_seqlens: torch.Tensor
    batch_size: int
    host_offsets: list[int] | None = None
    _ids: torch.Tensor | None = field(default=None, repr=False)

    @property
    def seq_length(self) -> int:
        return self.offsets[-1] // self.batch_size

    @property
    def offsets(self) -> list[int]:
        if self.host_offsets is None:
            self.host_offsets = self.cu_seqlens.tolist()
        return self.host_offsets

    def token_documents(self) -> torch.Tensor:
        """[b, N] index of each token's document, on the offsets' device (O(N); computed
        once per micro-batch, not per layer)."""
        if self._ids is None:
            cu = self.cu_seqlens.long()
            flat = torch.arange(self.offsets[-1], device=cu.device)
            self._ids = torch.searchsorted(cu[1:], flat, right=True).view(self.batch_size, -1)
        return self._ids

    @property
    def max_seqlen(self) -> int:
        offsets = self.offsets
        return max(b - a for a, b in zip(offsets, offsets[1:]))


def document_mask_of(batch: dict) -> DocumentMask | None:
    """The DocumentMask of a micro-batch dict (None without --reset-attention-mask), with the
    host offsets the batch carries as "document_offsets". Built once and kept in the dict as
    "documents": every pipeline chunk of the micro-batch, and its backward, share it (and its
    token-to-document index)."""
    if "documents" not in batch:
        cu = batch.get("cu_seqlens")
        batch["documents"] = (
            None
            if cu is None
            else DocumentMask(cu, batch["tokens"].shape[0], batch.get("document_offsets"))
        )
    return batch["documents"]


# ---- the memory-linear SDPA path -----------------------------------------------------------
def document_blocks(offsets: list[int], seq_length: int, window: int | None):
    """(sample, q0, q1, k0, k1, needs_mask) per block, positions within the sample."""
    blocks = []
    for start, end in zip(offsets, offsets[1:]):
        sample, ds = divmod(start, seq_length)
        de = end - sample * seq_length
        if window is None or window >= de - ds - 1:
            blocks.append((sample, ds, de, ds, de, False))
            continue
        for q0 in range(ds, de, WINDOW_QUERY_BLOCK):
            q1 = min(q0 + WINDOW_QUERY_BLOCK, de)
            blocks.append((sample, q0, q1, max(ds, q0 - window), q1, True))
    return blocks


def _block_attention(q, k, v, block, window, dropout_p, scale):
    """One block: q [Lq, h, d], k/v [Lk, hk, d] -> [Lq, h, d]."""
    _, q0, q1, k0, k1, needs_mask = block
    k, v = expand_kv_for_sdpa(q, k, v, needs_mask, heads_dim=1)
    q_, k_, v_ = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, h, L, d]
    gqa = k.shape[1] != q.shape[1]
    if not needs_mask:
        out = F.scaled_dot_product_attention(
            q_, k_, v_, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:
        distance = torch.arange(q0, q1, device=q.device).unsqueeze(1) - torch.arange(
            k0, k1, device=q.device
        ).unsqueeze(0)
        visible = (distance >= 0) & (distance <= window)
        out = F.scaled_dot_product_attention(
            q_, k_, v_, attn_mask=visible, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
    return out.squeeze(0).transpose(0, 1)


class BlockwiseAttention(torch.autograd.Function):
    """q [N, b, hq, d], k/v [N, b, hk, d] -> [N, b, hq, d]; keeps only q, k, v (and the
    generator state, so that backward redraws the same dropout masks block by block)."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, window, dropout_p, scale):
        ctx.rng = device_rng_get(q.device.type) if dropout_p > 0 else None
        out = q.new_empty(q.shape)
        for block in blocks:
            b, q0, q1, k0, k1, _ = block
            out[q0:q1, b] = _block_attention(
                q[q0:q1, b], k[k0:k1, b], v[k0:k1, b], block, window, dropout_p, scale
            )
        ctx.save_for_backward(q, k, v)
        ctx.blocks, ctx.window, ctx.dropout_p, ctx.scale = blocks, window, dropout_p, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        device_type = q.device.type
        current = device_rng_get(device_type)
        if ctx.rng is not None:
            device_rng_set(ctx.rng, device_type)
        try:
            for block in ctx.blocks:
                if _writes_in_place(q, k, block, ctx.dropout_p):
                    _document_backward_in_place(
                        dq, dk, dv, q, k, v, grad_out, block, ctx.window, ctx.scale
                    )
                    continue
                b, q0, q1, k0, k1, _ = block
                pieces = [
                    t.detach().requires_grad_() for t in (q[q0:q1, b], k[k0:k1, b], v[k0:k1, b])
                ]
                bq, bk, bv = pieces
                with torch.enable_grad():
                    out = _block_attention(bq, bk, bv, block, ctx.window, ctx.dropout_p, ctx.scale)
                gq, gk, gv = torch.autograd.grad(out, pieces, grad_out[q0:q1, b])
                del out, pieces, bq, bk, bv  # not alive while the next block recomputes
                dq[q0:q1, b] += gq
                dk[k0:k1, b] += gk
                dv[k0:k1, b] += gv
                del gq, gk, gv
        finally:
            device_rng_set(current, device_type)
        return dq, dk, dv, None, None, None, None


def _writes_in_place(q, k, block, dropout_p: float) -> bool:
    """Whether a block's backward adds tile by tile into dq/dk/dv: torch's CPU flash kernel
    (it returns the log-sum-exp the tiles need, takes GQA and a bias) and no dropout (tiles
    would redraw the masks; with dropout the block's gradients come from autograd and are
    added in, one block's at a time).

    Half precision too: the kernel itself (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp,
    cpu_flash_attention_backward) accumulates grad_q, grad_k and grad_v in the input dtype,
    one bf16/fp16 rounding per (query block, key block) pair of its own (GEMMs with beta 1
    into the half-precision gradients). A tile pair's gradient added into the accumulator is
    one more rounding per tile pair, at most one per two of the kernel's own (a tile holds
    two or more of its blocks), so the error stays of the kernel's order; the test holds it
    to an fp64 reference beside the whole-document call."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        and dropout_p == 0
    )


def tile_pairs(length_q: int, length_k: int, q_at: int, k_at: int, window, masked: bool):
    """The engine's plan of one document block's backward: (query tile, key tile) pairs of
    DOCUMENT_GRAD_TILE rows that some query sees some key of, in block-local rows; `q_at`,
    `k_at`: the positions of the block's first query and key. Unmasked (a whole causal
    document, q_at == k_at): the diagonal pairs causal, the pairs below it full. Masked (the
    window cuts the block): pairs the window and causality leave whole run full, the rest
    with the bias."""
    tile, plan = DOCUMENT_GRAD_TILE, []
    for r0 in range(0, length_q, tile):
        r1 = min(r0 + tile, length_q)
        for c0 in range(0, length_k, tile):
            c1 = min(c0 + tile, length_k)
            nearest = (q_at + r0) - (k_at + c1 - 1)  # the smallest query - key distance
            farthest = (q_at + r1 - 1) - (k_at + c0)
            if farthest < 0 or (window is not None and nearest > window):
                continue  # no query of the tile sees a key of this one
            if not masked:
                mask = Mask.CAUSAL if r0 == c0 else Mask.FULL
            elif nearest >= 0 and (window is None or farthest <= window):
                mask = Mask.FULL
            else:
                mask = Mask.BIAS
            plan.append(Block(r0, r1, c0, c1, mask, q_at=q_at + r0, k_at=k_at + c0))
    return plan


def _document_backward_in_place(dq, dk, dv, q, k, v, grad_out, block, window, scale) -> None:
    """One block's gradients added into dq/dk/dv tile pair by tile pair on the blocked engine:
    the block's output and log-sum-exp are recomputed once, then each (query tile, key tile)
    pair some query of which sees some key runs the flash backward with the block's own output
    and log-sum-exp, which makes its contributions exact partial sums. Only tile-sized
    gradients exist besides the accumulators, never a whole document's dq, dk and dv next to
    them; everything of this block is freed before the next block's recompute."""
    b, q0, q1, k0, k1, masked = block

    def part(t, lo, hi):  # the block's rows of one sample, [L, 1, h, d] views
        return t[lo:hi, b : b + 1]

    qd, kd, vd = part(q, q0, q1), part(k, k0, k1), part(v, k0, k1)
    rules = engine.MaskRules(window)
    whole = Block(0, q1 - q0, 0, k1 - k0, Mask.BIAS, q_at=q0, k_at=k0)
    bias = rules.bias(whole, q.dtype, q.device) if masked else None
    out, lse = CPU_FLASH.forward(
        engine.rows(qd, 0, q1 - q0, None, None),
        engine.rows(kd, 0, k1 - k0, None, None),
        engine.rows(vd, 0, k1 - k0, None, None),
        not masked,
        bias,
        scale,
    )
    del bias
    engine.backward(
        part(grad_out, q0, q1),
        qd,
        kd,
        vd,
        out.permute(2, 0, 1, 3),  # [1, h, L, d] -> [L, 1, h, d], a view
        lse,
        part(dq, q0, q1),
        part(dk, k0, k1),
        part(dv, k0, k1),
        tile_pairs(q1 - q0, k1 - k0, q0, k0, window, masked),
        engine.Kernels(CPU_FLASH, CPU_FLASH),
        rules,
        scale,
    )


# ---- flash-attn ----------------------------------------------------------------------------
def flash_documents(q, k, v, documents, window, dropout_p, scale):
    """flash_attn_varlen_func over the documents (flash_attn_func with only a window)."""
    n, b = q.shape[:2]
    flash_attn = flash_attn_module()
    window_size = (window, 0) if window is not None else (-1, -1)
    if documents is None:
        out = flash_attn.flash_attn_func(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            dropout_p=dropout_p,
            softmax_scale=scale,
            causal=True,
            window_size=window_size,
        )
        return out.transpose(0, 1)
    packed = [t.transpose(0, 1).reshape(b * n, *t.shape[2:]) for t in (q, k, v)]
    cu = documents.cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    longest = documents.max_seqlen
    out = flash_attn.flash_attn_varlen_func(
        *packed,
        cu,
        cu,
        longest,
        longest,
        dropout_p=dropout_p,
        softmax_scale=scale,
        causal=True,
        window_size=window_size,
    )
    return out.reshape(b, n, *out.shape[1:]).transpose(0, 1)
