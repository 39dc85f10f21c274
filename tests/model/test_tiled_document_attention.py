"""Documents and windows on fused kernels without a loop per document
(model/attention/document_tiles.py): exact against the dense reference mask in fp64 on torch's
CPU flash kernel, forward and backward, for documents that start anywhere in a tile (several
in one tile), windows that cut tiles, GQA; within bf16 rounding on the stand-in of torch's CUDA
efficient kernel (the kernel a CUDA run without flash-attn uses); kernel calls per tile do not
grow with the number of documents. With attention dropout on the efficient kernel's stand-in
the tiles equal dense fp64 attention with the same keep-masks (each call's, from the philox
seed and offset it drew), the seed decides the masks, and activation recomputation draws the
same ones again."""

import pytest
import torch

from megatron_ul.model.attention import document_tiles as tiled
from megatron_ul.model.attention import lse_kernels
from megatron_ul.model.attention.documents import DocumentMask
from megatron_ul.mpu.random import MODEL_PARALLEL_RNG, get_rng_tracker
from megatron_ul.mpu.recompute import checkpoint
from tests.dense_masks import dense_document_mask
from tests.stand_ins.sdpa_efficient_cuda import EfficientOps, keep_scale

N, B = 96, 2
CASES = [
    ((), None),
    ((5, 19, 40, 41, 42, 80), None),
    ((5, 19, 40, 41, 42, 80), 7),
    ((), 20),
    ((32, 64), 30),
]


def _reference(q, k, v, hidden, keep=None):
    """Dense softmax attention in q's dtype; with `keep` [b, h, N, N] (the kernel's scaled
    keep-mask) applied to the normalised probabilities."""
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("nbhd,mbhd->bhnm", q, k.repeat_interleave(g, 2)) / q.shape[-1] ** 0.5
    p = s.masked_fill(hidden, float("-inf")).softmax(-1)
    if keep is not None:
        p = p * keep.to(p.dtype)
    return torch.einsum("bhnm,mbhd->nbhd", p, v.repeat_interleave(g, 2))


def _check(starts, window, tile, dtype, kernel, tol, monkeypatch):
    monkeypatch.setattr(tiled, "TILE", tile)
    offsets = [r * N + s for r in range(B) for s in ((0, *starts) if r == 0 else (0,))]
    documents = DocumentMask(torch.tensor(offsets + [B * N], dtype=torch.int32), B)
    hidden = dense_document_mask(documents)
    if window is not None:
        hidden = hidden | (torch.arange(N).unsqueeze(1) - torch.arange(N).unsqueeze(0) > window)
    g = torch.Generator().manual_seed(tile)
    full = [
        torch.randn(N, B, h, 8, generator=g, dtype=torch.float64).requires_grad_()
        for h in (4, 2, 2)
    ]
    mine = [t.detach().to(dtype).requires_grad_() for t in full]
    out = tiled.tiled_document_attention(*mine, documents, window, None, kernel)
    ref = _reference(*full, hidden)
    weights = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (out.double() * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(out.double(), ref.detach(), **tol)
    for a, b in zip(mine, full):
        assert a.grad.dtype == dtype
        torch.testing.assert_close(a.grad.double(), b.grad, **tol)


@pytest.mark.parametrize("starts,window", CASES)
@pytest.mark.parametrize("tile", [16, 32])
def test_tiles_match_the_dense_reference_fp64(starts, window, tile, monkeypatch):
    _check(
        starts,
        window,
        tile,
        torch.float64,
        lse_kernels.CPU_FLASH,
        dict(atol=1e-12, rtol=1e-12),
        monkeypatch,
    )


@pytest.mark.parametrize("starts,window", CASES[1:3])
def test_tiles_on_the_efficient_kernel_stand_in_bf16(starts, window, monkeypatch):
    ops = EfficientOps()
    monkeypatch.setattr(lse_kernels, "cuda_ops", ops)
    _check(
        starts,
        window,
        16,
        torch.bfloat16,
        lse_kernels.SDPA_EFFICIENT,
        dict(atol=3e-2, rtol=3e-2),
        monkeypatch,
    )
    assert ops.calls["forward"] > 0 and ops.calls["backward"] > 0


def test_calls_per_tile_do_not_grow_with_documents():
    n = 20480
    few = tiled.plan([[0, 4096, 12000]], n, None)
    many = tiled.plan([list(range(0, n, 2))], n, None)  # 10240 two-token documents
    tiles = n // tiled.TILE
    assert len(many) <= 2 * tiles and len(few) <= 3 * tiles
    assert max(c.k1 - c.k0 for c in many + few if c.masked) <= 3 * tiled.TILE


# ---- attention dropout on the efficient kernel's stand-in ------------------------------------
P_DROP = 0.2


def _documents_and_hidden(starts, window):
    offsets = [r * N + s for r in range(B) for s in ((0, *starts) if r == 0 else (0,))]
    documents = DocumentMask(torch.tensor(offsets + [B * N], dtype=torch.int32), B)
    hidden = dense_document_mask(documents)
    if window is not None:
        hidden = hidden | (torch.arange(N).unsqueeze(1) - torch.arange(N).unsqueeze(0) > window)
    return documents, hidden


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = [
        torch.randn(N, B, h, 8, generator=g, dtype=torch.float64).requires_grad_()
        for h in (4, 2, 2)
    ]
    return full, [t.detach().to(dtype).requires_grad_() for t in full]


def _dense_keep(ops, calls, heads):
    """Every call's keep-mask (from the seed and offset it drew) at its place in [b, h, N, N]."""
    assert len(ops.philox) == len(calls)
    keep = torch.zeros(B, heads, N, N)
    for c, (seed, offset, shape, p) in zip(calls, ops.philox):
        assert shape == (1, heads, c.q1 - c.q0, c.k1 - c.k0) and p == P_DROP
        keep[c.sample, :, c.q0 : c.q1, c.k0 : c.k1] = keep_scale(seed, offset, shape, p)[0]
    return keep


@pytest.mark.parametrize("starts,window", CASES[1:4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_with_dropout_equal_dense_attention_with_the_same_masks(
    starts, window, dtype, monkeypatch
):
    ops = EfficientOps()
    monkeypatch.setattr(lse_kernels, "cuda_ops", ops)
    monkeypatch.setattr(tiled, "TILE", 16)
    documents, hidden = _documents_and_hidden(starts, window)
    full, mine = _inputs(dtype)
    torch.manual_seed(3)
    out = tiled.tiled_document_attention(
        *mine, documents, window, None, lse_kernels.SDPA_EFFICIENT, dropout_p=P_DROP
    )
    calls = tiled.plan(tiled.document_starts(documents.offsets, N, B), N, window)
    keep = _dense_keep(ops, calls, 4)
    ref = _reference(*full, hidden, keep)
    weights = torch.randn(
        ref.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64
    )
    (out.double() * weights).sum().backward()
    (ref * weights).sum().backward()
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.double(), ref.detach(), **tol)
    for a, b in zip(mine, full):
        torch.testing.assert_close(a.grad.double(), b.grad, **tol)
    assert ops.calls["backward"] == len(calls)  # each call's gradients with its own masks
    # dropout happened: the undropped attention is far from it
    assert not torch.allclose(out.double(), _reference(*full, hidden).detach(), atol=0.05)


def test_tiles_dropout_follows_the_seed(monkeypatch):
    monkeypatch.setattr(lse_kernels, "cuda_ops", EfficientOps())
    monkeypatch.setattr(tiled, "TILE", 16)
    documents, _ = _documents_and_hidden((5, 19, 40), 7)
    _, mine = _inputs(torch.float32)
    outs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        outs.append(
            tiled.tiled_document_attention(
                *mine, documents, 7, None, lse_kernels.SDPA_EFFICIENT, dropout_p=P_DROP
            )
        )
    assert torch.equal(outs[0], outs[1]) and not torch.allclose(outs[0], outs[2])
    with pytest.raises(ValueError, match="--attention-dropout 0.2: .* not on cpu-flash"):
        tiled.tiled_document_attention(
            *mine, documents, 7, None, lse_kernels.CPU_FLASH, dropout_p=P_DROP
        )


def test_tiles_dropout_masks_replayed_by_activation_recomputation(monkeypatch):
    """Under mpu.recompute.checkpoint the forward runs again in backward: it must draw the same
    philox seeds and offsets (the generator and the tracker's stream are replayed), so the
    gradients equal those of the run without recomputation, and differ from another seed's."""
    ops = EfficientOps()
    monkeypatch.setattr(lse_kernels, "cuda_ops", ops)
    monkeypatch.setattr(tiled, "TILE", 16)
    tracker = get_rng_tracker()
    monkeypatch.setattr(tracker, "states", {})
    monkeypatch.setattr(tracker, "device_type", "cpu")
    documents, _ = _documents_and_hidden((5, 19, 40, 41, 42, 80), 7)

    def attention(q, k, v):
        with tracker.fork():
            return tiled.tiled_document_attention(
                q, k, v, documents, 7, None, lse_kernels.SDPA_EFFICIENT, dropout_p=P_DROP
            )

    weights = torch.randn(N, B, 4, 8, generator=torch.Generator().manual_seed(2))
    results = []
    for seed, recompute in ((11, False), (11, True), (12, True)):
        tracker.states = {}
        tracker.add(MODEL_PARALLEL_RNG, seed)
        _, mine = _inputs(torch.float32)
        before = ops.calls["forward"]
        out = checkpoint(attention, *mine) if recompute else attention(*mine)
        (out * weights).sum().backward()
        forwards = ops.calls["forward"] - before
        results.append((out.detach(), [t.grad for t in mine], forwards))
    (plain, plain_grads, n_plain), (again, again_grads, n_again), (other, other_grads, _) = results
    assert n_again == 2 * n_plain  # the forward did run again
    assert torch.equal(plain, again)
    for a, b in zip(plain_grads, again_grads):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.allclose(plain, other) and not torch.allclose(plain_grads[0], other_grads[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_dispatch_and_runtime_agree_on_tiles_with_dropout(dtype, dropout):
    """The selection names document tiles on CUDA with dropout (fp64: the loop, its kernel takes
    no dropout), and the tiles it builds run torch's efficient kernel (the reference for fp64
    without dropout)."""
    from megatron_ul.model.attention.backends import DocumentTiles, select
    from megatron_ul.model.attention.dispatch import AttentionCall

    cuda = torch.device("cuda")
    for documents, window in ((True, None), (False, 64), (True, 64)):
        call = AttentionCall(
            cuda, dtype, 64, 8, 8, documents, window, dropout=dropout, flash_attn_installed=False
        )
        backend = select(call)
        assert backend.name == (
            "document blocks" if dropout and dtype == torch.float64 else "document tiles"
        )
        if isinstance(backend, DocumentTiles):
            fp64 = dtype == torch.float64
            assert backend.kernel is (lse_kernels.REFERENCE if fp64 else lse_kernels.SDPA_EFFICIENT)
