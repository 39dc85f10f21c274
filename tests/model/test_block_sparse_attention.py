"""Block-sparse attention against the softmax written out in fp64 over the dense token mask
(layout expanded to tokens, causal, documents, window: tests only), forward and backward; the
engine's blocks cover each computed block exactly once; the CUDA path through the strict stand-in
of torch's efficient kernel."""

import numpy as np
import pytest
import torch

from megatron_ul.model.attention import lse_kernels
from megatron_ul.model.attention.block_sparse import LayerSparsity, block_sparse_attention
from megatron_ul.model.attention.block_sparse_layouts import block_layout
from megatron_ul.model.attention.blocks import Kernels, Mask, layout_blocks
from megatron_ul.model.attention.documents import DocumentMask
from megatron_ul.model.attention.ring import DocumentSpans
from megatron_ul.sparsity_config import SparsityPattern
from tests.stand_ins.sdpa_efficient_cuda import EfficientOps

N, B, HQ, HK, D, BLOCK = 64, 2, 4, 2, 8, 8
CPU = Kernels(lse_kernels.CPU_FLASH, lse_kernels.CPU_FLASH)

PATTERNS = {
    "fixed": dict(num_local_blocks=2, different_layout_per_head=True,
                  num_different_global_patterns=2),
    "bigbird": dict(num_random_blocks=2, different_layout_per_head=True),
    "bslongformer": dict(num_sliding_window_blocks=1, global_block_indices=[2, 5]),
    "variable": dict(local_window_blocks=[1, 3], global_block_indices=[1], num_random_blocks=1,
                     attention="bidirectional", horizontal_global_attention=True),
}  # fmt: skip


def _reference(q, k, v, mask, scale):
    """q [N, b, hq, d]; mask [b, hq, N, N] True = visible; fp64 softmax written out."""
    group = q.shape[2] // k.shape[2]
    kx, vx = (t.repeat_interleave(group, 2) for t in (k, v))
    s = torch.einsum("qbhd,kbhd->bhqk", q, kx) * scale
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    return torch.einsum("bhqk,kbhd->qbhd", p, vx)


def _token_mask(pattern, heads, seed, layer, documents, window):
    layout = block_layout(pattern, heads, N, seed=seed, layer=layer)
    mask = layout.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)  # [h, N, N]
    pos = torch.arange(N)
    visible = pos.unsqueeze(0) <= pos.unsqueeze(1)
    if window is not None:
        visible = visible & (pos.unsqueeze(1) - pos.unsqueeze(0) <= window)
    visible = mask.unsqueeze(0) & visible
    if documents is not None:
        ids = documents.token_documents()
        visible = visible & (ids.unsqueeze(2) == ids.unsqueeze(1)).unsqueeze(1)
    return visible.expand(B, heads, N, N)


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(N, B, h, D, generator=g, dtype=dtype).requires_grad_() for h in (HQ, HK, HK)
    ]


DOCS = DocumentMask(torch.tensor([0, 13, 40, 64, 64 + 30, 128], dtype=torch.int32), B)


@pytest.mark.parametrize("mode", list(PATTERNS))
@pytest.mark.parametrize("documents,window", [(None, None), (DOCS, None), (DOCS, 19), (None, 11)])
def test_matches_fp64_dense_masked_reference(mode, documents, window):
    pattern = SparsityPattern.create(mode, block=BLOCK, **PATTERNS[mode])
    sparsity = LayerSparsity(pattern, HQ, seed=5, layer=2)
    q, k, v = _inputs()
    out = block_sparse_attention(
        q, k, v, sparsity.plan(N, range(HQ), HK), kernels=CPU, documents=documents, window=window
    )
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    mask = _token_mask(pattern, HQ, 5, 2, documents, window)
    want = _reference(q, k, v, mask, D**-0.5)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_a_ranks_global_heads_take_their_own_layout_rows():
    """Ulysses: a rank holding global heads 2 and 3 (and kv head 1) computes what the whole
    model computes for those heads."""
    pattern = SparsityPattern.create("bigbird", block=BLOCK, **PATTERNS["bigbird"])
    sparsity = LayerSparsity(pattern, HQ, seed=1, layer=0)
    q, k, v = _inputs()
    whole = block_sparse_attention(q, k, v, sparsity.plan(N, range(HQ), HK), kernels=CPU)
    part = block_sparse_attention(
        q[:, :, 2:].detach(), k[:, :, 1:].detach(), v[:, :, 1:].detach(),
        sparsity.plan(N, [2, 3], 1), kernels=CPU,
    )  # fmt: skip
    assert torch.equal(part, whole[:, :, 2:].detach())
    other = block_sparse_attention(
        q[:, :, 2:].detach(), k[:, :, 1:].detach(), v[:, :, 1:].detach(),
        sparsity.plan(N, [0, 1], 1), kernels=CPU,
    )  # fmt: skip
    assert not torch.equal(other, part)  # the rows of other heads would differ


@pytest.mark.parametrize("mode", list(PATTERNS))
def test_layout_blocks_cover_each_computed_block_once(mode):
    pattern = SparsityPattern.create(mode, block=1, **PATTERNS[mode])
    for head in range(HQ):
        layout = block_layout(pattern, HQ, 40, seed=3, heads=[head])[0].numpy()
        count = np.zeros((40, 40), dtype=int)
        for r in layout_blocks(layout, 1):
            if r.mask is Mask.CAUSAL:
                count[r.q0 : r.q1, r.k0 : r.k1] += np.tril(np.ones((r.q1 - r.q0,) * 2, int))
            else:
                count[r.q0 : r.q1, r.k0 : r.k1] += 1
        assert (count == np.tril(layout)).all()


def test_cuda_path_runs_the_efficient_kernel_through_the_strict_stand_in(monkeypatch):
    """fp32 on the stand-in of torch's efficient CUDA kernel (its layout, alignment and lse
    rules) against the fp64 reference."""
    monkeypatch.setattr(lse_kernels, "cuda_ops", EfficientOps())
    pattern = SparsityPattern.create("fixed", block=BLOCK, **PATTERNS["fixed"])
    q, k, v = _inputs(torch.float32)
    kernels = Kernels(lse_kernels.SDPA_EFFICIENT, lse_kernels.SDPA_EFFICIENT)
    plan = LayerSparsity(pattern, HQ, seed=0, layer=0).plan(N, range(HQ), HK)
    out = block_sparse_attention(q, k, v, plan, documents=DOCS, window=19, kernels=kernels)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = _reference(*wide, _token_mask(pattern, HQ, 0, 0, DOCS, 19), D**-0.5)
    want_grads = torch.autograd.grad(want, wide, dout.double())
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-5)


def test_time_follows_the_blocks_calls_skip_what_documents_exclude():
    pattern = SparsityPattern.create("bslongformer", block=BLOCK, num_sliding_window_blocks=1,
                                     global_block_indices=[0])  # fmt: skip
    plan = LayerSparsity(pattern, HQ, 0, 0).plan(N, range(HQ), HK)

    one_document = plan.calls(None, None)
    # a document start at every block: only the diagonal squares remain
    docs = DocumentMask(torch.arange(0, 2 * N + 1, BLOCK, dtype=torch.int32), B)
    split = plan.calls(None, DocumentSpans.of(docs))
    assert len(split) < len(one_document)
    assert all(c.q0 == c.k0 and c.q1 == c.k1 for c in split)


@pytest.mark.parametrize("flash_attn_stand_in", ["2.8.3"], indirect=True)
def test_the_tables_row_runs_per_head_blocks_on_flash_attn_through_the_stand_in(
    flash_attn_stand_in,
):
    """--use-flash-attn, bf16: select() gives the block-sparse row flash-attn for whole blocks
    (per-head layouts: head-sliced views) and the CPU kernel for the blocks documents and the
    window cut; against the fp64 reference at bf16's tolerance."""
    from megatron_ul.model.attention.backends import BlockSparse, select
    from megatron_ul.model.attention.block_sparse import SparseHeads
    from megatron_ul.model.attention.dispatch import AttentionCall

    pattern = SparsityPattern.create("bigbird", block=BLOCK, **PATTERNS["bigbird"])
    heads = SparseHeads(pattern, HQ, seed=5, layer=2)
    call = AttentionCall(torch.device("cpu"), torch.bfloat16, D, HQ, HK, True, 19,
                         use_flash_attn=True, sparse=heads)  # fmt: skip
    backend = select(call)
    assert isinstance(backend, BlockSparse) and backend.name == "block-sparse bigbird: " + (
        "flash-attn / cpu-flash"
    )
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in _inputs())
    out = backend.forward(q, k, v, call, documents=DOCS, ring=None, softmax_scale=None)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(out, (q, k, v), dout.bfloat16())
    assert flash_attn_stand_in.calls["_flash_attn_forward"] > 0
    assert flash_attn_stand_in.calls["_flash_attn_backward"] > 0
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = _reference(*wide, _token_mask(pattern, HQ, 5, 2, DOCS, 19), D**-0.5)
    want_grads = torch.autograd.grad(want, wide, dout.double())
    torch.testing.assert_close(out.double(), want, rtol=0, atol=3e-2)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=6e-2)


def test_heads_sharing_a_layout_share_calls_in_ranges_the_kv_groups_allow():
    """Per-head layouts: consecutive equal layouts run as one head range, cut where a range
    would span part of a kv head's group (the engine gives a range within one group that
    group's kv head, a range of whole groups theirs)."""
    from megatron_ul.model.attention.block_sparse import head_layouts

    per_head = SparsityPattern.create("fixed", block=BLOCK, different_layout_per_head=True)
    same, other = torch.eye(3, dtype=torch.bool), torch.ones(3, 3, dtype=torch.bool)
    # 8 query heads, 2 kv heads (groups of 4): heads 1-6 share a layout, 0 and 7 differ
    layouts = {0: other, 7: other.tril()} | {h: same for h in range(1, 7)}
    got = [hs for hs, _ in head_layouts(per_head, range(8), 2, layouts.__getitem__)]
    assert got == [(0, 1), (1, 4), (4, 7), (7, 8)]
    # all heads alike: one range, whole groups
    got = [hs for hs, _ in head_layouts(per_head, range(8), 2, lambda h: same)]
    assert got == [(0, 8)]
    plan = LayerSparsity(per_head, HQ, seed=0, layer=0).plan(N, range(HQ), HK)
    shared = SparsityPattern.create("fixed", block=BLOCK)
    assert {b.heads for b in plan.blocks} == {(0, HQ)}
    assert len(plan.blocks) == len(LayerSparsity(shared, HQ, 0, 0).plan(N, range(HQ), HK).blocks)
