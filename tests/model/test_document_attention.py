"""Document masking and sliding windows without an N×N mask: the memory-linear attention
equals attention written out with a dense mask (forward and q/k/v gradients, fp64), for
documents, windows, both, GQA and several samples; dropout masks are redrawn identically in
backward; nothing of size N² is saved."""

import math

import pytest
import torch

from megatron_ul.model.attention import documents as da
from megatron_ul.model.attention.documents import DocumentMask
from megatron_ul.model.attention.layer import document_attention
from megatron_ul.mpu.random import MODEL_PARALLEL_RNG, get_rng_tracker
from tests.dense_masks import dense_document_mask
from tools.bench.saved_bytes import saved_activation_bytes

N, B, D = 40, 2, 8


@pytest.fixture(autouse=True)
def tracker():
    get_rng_tracker().reset()
    get_rng_tracker().add(MODEL_PARALLEL_RNG, 5)


def written_out(q, k, v, masked):
    """Softmax attention with an explicit [b, 1, N, N] mask (True = masked); GQA by index."""
    hq, hk = q.shape[2], k.shape[2]
    kv_of = torch.arange(hq) // (hq // hk)
    k, v = k[:, :, kv_of], v[:, :, kv_of]
    scores = torch.einsum("nbhd,mbhd->bhnm", q, k) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(masked, float("-inf")).softmax(-1)
    return torch.einsum("bhnm,mbhd->nbhd", probs, v)


def window_mask(n: int, left: int) -> torch.Tensor:
    i = torch.arange(n)
    distance = i.unsqueeze(1) - i.unsqueeze(0)
    return ~((distance >= 0) & (distance <= left))  # True = masked


DOCUMENTS = torch.tensor([0, 1, 9, 10, 31, 40, 45, 46, 80], dtype=torch.int32)  # 1-token docs too


@pytest.mark.parametrize("grad_tile", [1024, 3])  # 3: every block's backward in tile pairs
@pytest.mark.parametrize(
    "case", ["documents", "window", "documents+window", "gqa", "window-longer-than-documents"]
)
def test_matches_dense_mask(case, grad_tile, monkeypatch):
    monkeypatch.setattr(da, "WINDOW_QUERY_BLOCK", 7)  # several uneven blocks per document
    monkeypatch.setattr(da, "DOCUMENT_GRAD_TILE", grad_tile)
    hq, hk = (8, 2) if case == "gqa" else (4, 4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(N, B, h, D, generator=g, dtype=torch.float64, requires_grad=True)
        for h in (hq, hk, hk)
    )
    docs = DocumentMask(DOCUMENTS, B) if "documents" in case or case == "gqa" else None
    window = {"window": 5, "documents+window": 3, "window-longer-than-documents": 30}.get(case)
    if case == "window-longer-than-documents":
        docs = DocumentMask(DOCUMENTS, B)
    masked = torch.zeros(B, 1, N, N, dtype=torch.bool) | ~torch.ones(N, N, dtype=torch.bool).tril()
    if docs is not None:
        masked |= dense_document_mask(docs)
    if window is not None:
        masked |= window_mask(N, window)
    out = document_attention(q, k, v, backend="sdpa", dropout_p=0.0, documents=docs, window=window)
    ref = written_out(q, k, v, masked)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for name, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_dropout_masks_replayed_in_backward(monkeypatch):
    """Backward recomputes every block; it must draw the same dropout masks as forward: the
    gradients equal those of the same blocks run with plain autograd from the same RNG state."""
    monkeypatch.setattr(da, "WINDOW_QUERY_BLOCK", 7)
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(N, B, 4, D, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    )
    docs, window = DocumentMask(DOCUMENTS, B), 6
    blocks = da.document_blocks(docs.offsets, N, window)
    state = torch.get_rng_state()
    out = da.BlockwiseAttention.apply(q, k, v, blocks, window, 0.3, None)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    torch.set_rng_state(state)
    ref = torch.zeros_like(out)
    for block in blocks:
        b, q0, q1, k0, k1, _ = block
        ref[q0:q1, b] = da._block_attention(
            q[q0:q1, b], k[k0:k1, b], v[k0:k1, b], block, window, 0.3, None
        )
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for name, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_saves_only_q_k_v():
    n = 2048
    q, k, v = (torch.randn(n, 1, 2, 16, requires_grad=True) for _ in range(3))
    docs = DocumentMask(torch.tensor([0, 700, 1500, n], dtype=torch.int32), 1)
    _, saved = saved_activation_bytes(
        lambda: document_attention(
            q, k, v, backend="sdpa", dropout_p=0.0, documents=docs, window=256
        ),
        exclude=[],
    )
    assert saved == 3 * q.numel() * 4  # q, k, v themselves; no [N, N] anything


@pytest.mark.parametrize("documents, window", [(True, None), (True, 3), (False, 5)])
def test_flash_path_matches_blockwise_path(flash_attn_stand_in, documents, window):
    """The GPU path (flash_attn_varlen_func with cu_seqlens, or flash_attn_func, with
    window_size) under the strict stand-in: the real API's dtype/layout/cu_seqlens checks pass
    and the result equals the memory-linear path, forward and backward (bf16 rounding)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(N, B, h, D, generator=g).to(torch.bfloat16).requires_grad_() for h in (4, 2, 2)
    )
    docs = DocumentMask(DOCUMENTS, B) if documents else None
    out = document_attention(q, k, v, backend="flash", dropout_p=0.0, documents=docs, window=window)
    kernel = "flash_attn_varlen_func" if documents else "flash_attn_func"
    assert flash_attn_stand_in.calls[kernel] == 1
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = document_attention(
        *ref_inputs, backend="sdpa", dropout_p=0.0, documents=docs, window=window
    )
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    w = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_inputs)
    for name, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a.float(), b, rtol=5e-2, atol=5e-2, msg=name)
