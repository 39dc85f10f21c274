"""Documents and windows on fused kernels without a loop per document
(model/tiled_document_attention.py): exact against the dense reference mask in fp64 on torch's
CPU flash kernel, forward and backward, for documents that start anywhere in a tile (several
in one tile), windows that cut tiles, GQA; within bf16 rounding on the stand-in of torch's CUDA
efficient kernel (the kernel a CUDA run without flash-attn uses); kernel calls per tile do not
grow with the number of documents."""

import pytest
import torch

from megatron_ul.model import lse_kernels
from megatron_ul.model import tiled_document_attention as tiled
from megatron_ul.model.document_attention import DocumentMask
from tests.dense_masks import dense_document_mask
from tests.stand_ins.sdpa_efficient_cuda import EfficientOps

N, B = 96, 2
CASES = [
    ((), None),
    ((5, 19, 40, 41, 42, 80), None),
    ((5, 19, 40, 41, 42, 80), 7),
    ((), 20),
    ((32, 64), 30),
]


def _reference(q, k, v, hidden):
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("nbhd,mbhd->bhnm", q, k.repeat_interleave(g, 2)) / q.shape[-1] ** 0.5
    p = s.masked_fill(hidden, float("-inf")).softmax(-1)
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
        starts, window, tile, torch.float64, "cpu-flash", dict(atol=1e-12, rtol=1e-12), monkeypatch
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
        "sdpa-efficient",
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
