"""The ring's unit kernels (model/attention/lse_kernels.py) and its host-side plan, in one process.

Each kernel, alone: out, lse and gradients (given the final lse) equal the softmax written out
in fp64, with causal units, GQA and an additive mask with rows that see nothing. Then the ring's
own step functions and plans for R virtual ranks (no process group; the exchange is the
identity here and is tested in test_ring_attention.py) reproduce full causal attention with
documents and windows on each kernel choice: torch's CPU flash kernel in fp64, and in bf16 the
flash-attn stand-in (tests/stand_ins/flash_attn) for unmasked units with the stand-in of torch's
CUDA efficient kernel (tests/stand_ins/sdpa_efficient_cuda.py) for masked ones."""

import dataclasses
import math

import pytest
import torch

from megatron_ul.data.sequence_layout import ring_local_positions
from megatron_ul.model.attention import lse_kernels
from megatron_ul.model.attention.backends import RingUnits, select
from megatron_ul.model.attention.dispatch import AttentionCall
from megatron_ul.model.attention.documents import DocumentMask
from megatron_ul.model.attention.layer import ring_attention
from megatron_ul.model.attention.ring import (
    Ring,
    backward_step,
    forward_step,
    measure_ring_time,
    packed_kv,
    ring_plan,
)
from tests.dense_masks import dense_document_mask
from tests.stand_ins.sdpa_efficient_cuda import EfficientOps

N, B, D = 32, 2, 8


def _explicit(q, k, v, causal, bias, scale):
    """[b, h, s, d] softmax attention in fp64 with autograd; GQA by repeating k/v."""
    g = q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.double()
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v.double().repeat_interleave(g, 1)


def _bias(b, sq, sk, dtype, empty_row=False):
    """-inf on a random pattern (every row sees its first key); with empty_row, query row 1
    sees nothing."""
    hidden = torch.rand(b, 1, sq, sk, generator=torch.Generator().manual_seed(1)) < 0.3
    hidden[..., 0] = False
    if empty_row:
        hidden[:, :, 1] = True
    bias = torch.zeros(b, 1, sq, 32, dtype=dtype)[..., :sk]  # rows 16-aligned, as the ring's
    return bias.masked_fill_(hidden, float("-inf"))


@pytest.fixture
def efficient_stand_in(monkeypatch):
    ops = EfficientOps()
    monkeypatch.setattr(lse_kernels, "cuda_ops", ops)
    return ops


CASES = [
    ("cpu-flash", torch.float64),
    ("reference", torch.float64),
    ("cpu-flash", torch.bfloat16),
    ("sdpa-efficient", torch.bfloat16),
    ("sdpa-efficient", torch.float32),
]


@pytest.mark.parametrize(
    "name,dtype", CASES, ids=[f"{n}-{d}".replace("torch.", "") for n, d in CASES]
)
@pytest.mark.parametrize("masking", ["causal", "bias"])
def test_unit_kernel_matches_explicit_softmax(name, dtype, masking, efficient_stand_in):
    _check_unit_kernel(name, dtype, masking)


def test_flash_attn_unit_kernel_under_each_release_matches_explicit_softmax(flash_attn_stand_in):
    """The ring's flash-attn unit kernel calls each release's private functions with its own
    calling convention (plain functions in 2.5/2.6, custom ops from 2.7)."""
    _check_unit_kernel("flash-attn", torch.bfloat16, "causal")
    calls = flash_attn_stand_in.calls
    assert calls["_flash_attn_forward"] == 1 and calls["_flash_attn_backward"] == 1


def _check_unit_kernel(name, dtype, masking):
    kernel = lse_kernels.kernel_named(name)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, D, generator=g).to(dtype) for h in (4, 2, 2))
    causal, bias = masking == "causal", _bias(2, 24, 24, dtype) if masking == "bias" else None
    scale = 1 / math.sqrt(D)
    out, lse = kernel.forward(q, k, v, causal, bias, scale)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _explicit(*leaves, causal, bias, scale)
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), ref.detach(), **tol)
    assert out.dtype == dtype and lse.dtype == lse_kernels.lse_dtype(dtype)
    if bias is not None:  # a row without keys merges as a no-op: out 0, lse -inf
        empty_out, empty_lse = kernel.forward(q, k, v, False, _bias(2, 24, 24, dtype, True), scale)
        assert torch.isneginf(empty_lse[:, :, 1]).all() and (empty_out[:, :, 1] == 0).all()
    dout = torch.randn(ref.shape, generator=g).to(dtype)
    grads = kernel.backward(dout, q, k, v, out, lse, causal, bias, scale)
    expected = torch.autograd.grad(ref, leaves, dout.double())
    for got, want, t in zip(grads, expected, (q, k, v)):
        assert got.shape == t.shape and got.dtype == dtype
        torch.testing.assert_close(got.double(), want, **tol)


def _documents(starts, rows):
    offsets = [r * N + s for r in range(B) for s in ((0, *starts) if r in rows else (0,))]
    return DocumentMask(torch.tensor(offsets + [B * N], dtype=torch.int32), B)


def _reference(q, k, v, documents, window):
    """[N, b, h, d] causal attention with the dense mask (test-only O(N²))."""
    hidden = ~torch.ones(N, N, dtype=torch.bool).tril()
    if window is not None:
        hidden = hidden | (torch.arange(N).unsqueeze(1) - torch.arange(N).unsqueeze(0) > window)
    if documents is not None:
        hidden = hidden | dense_document_mask(documents)
    bias = torch.zeros(hidden.shape, dtype=torch.float64).masked_fill(hidden, float("-inf"))
    bias = bias.expand(B, 1, N, N) if bias.dim() == 4 else bias.expand(B, 1, N, N)
    out = _explicit(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), False, bias, D**-0.5)
    return out.permute(2, 0, 1, 3)


def _virtual_ring(q, k, v, world, documents, window, kernels=None):
    """Every virtual rank's (out, dq) and the (dk, dv) of every block, through the ring's own
    plans and step functions; the loss is sum(out · weights)."""
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=q.dtype)
    length = N // world
    pos = [ring_local_positions(r, world, N) for r in range(world)]
    plans = [
        ring_plan(
            Ring(None, r, world, 0, 0),
            length,
            window=window,
            documents=documents,
        )
        for r in range(world)
    ]
    if kernels is not None:
        plans = [
            dataclasses.replace(
                p,
                dense=lse_kernels.kernel_named(kernels[0]),
                masked=lse_kernels.kernel_named(kernels[1]),
            )
            for p in plans
        ]
    blocks = [packed_kv(k[p], v[p]) for p in pos]
    acc = lse_kernels.lse_dtype(q.dtype)
    outs, lses = [], []
    for r, plan in enumerate(plans):
        out = torch.zeros(q[pos[r]].shape, dtype=acc)
        lse = torch.full((B, q.shape[2], length), float("-inf"), dtype=acc)
        for src in range(world):
            forward_step(q[pos[r]], out, lse, blocks[src], src, D**-0.5, plan)
        outs.append(out.to(q.dtype))
        lses.append(lse)
    dkv = [torch.zeros(b.shape, dtype=acc) for b in blocks]
    dqs = []
    for r, plan in enumerate(plans):
        dq = torch.zeros(outs[r].shape, dtype=acc)
        for src in range(world):
            backward_step(
                q[pos[r]],
                weights[pos[r]],
                outs[r],
                lses[r],
                blocks[src],
                dq,
                dkv[src],
                src,
                D**-0.5,
                plan,
            )
        dqs.append(dq)
    return pos, weights, outs, dqs, dkv


def _check_virtual_ring(dtype, world, documents, window, tol, kernels=None):
    g = torch.Generator().manual_seed(world)
    q, k, v = (
        torch.randn(N, B, h, D, generator=g, dtype=torch.float64).to(dtype) for h in (4, 2, 2)
    )
    pos, weights, outs, dqs, dkv = _virtual_ring(q, k, v, world, documents, window, kernels)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _reference(*leaves, documents, window)
    (ref * weights.double()).sum().backward()
    for r in range(world):
        torch.testing.assert_close(outs[r].double(), ref.detach()[pos[r]], **tol)
        torch.testing.assert_close(dqs[r].double(), leaves[0].grad[pos[r]], **tol)
        torch.testing.assert_close(dkv[r][0].double(), leaves[1].grad[pos[r]], **tol)
        torch.testing.assert_close(dkv[r][1].double(), leaves[2].grad[pos[r]], **tol)


MASKS = [
    (None, None),
    (_documents((5, 19), (0,)), None),
    (None, 5),
    (_documents((5, 19), (0,)), 5),
    (_documents((8, 24), (0, 1)), None),
]
MASK_IDS = ["causal", "documents", "window", "documents-window", "aligned-documents"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("documents,window", MASKS, ids=MASK_IDS)
def test_virtual_ring_on_cpu_flash_fp64_is_exact(world, documents, window):
    _check_virtual_ring(torch.float64, world, documents, window, dict(atol=1e-10, rtol=1e-10))


@pytest.mark.parametrize("documents,window", MASKS, ids=MASK_IDS)
def test_virtual_ring_on_flash_attn_and_efficient_stand_ins_bf16(
    documents, window, flash_attn_stand_in, efficient_stand_in
):
    _check_virtual_ring(
        torch.bfloat16,
        4,
        documents,
        window,
        dict(atol=3e-2, rtol=3e-2),
        kernels=("flash-attn", "sdpa-efficient"),
    )
    calls = flash_attn_stand_in.calls
    assert calls["_flash_attn_forward"] > 0 and calls["_flash_attn_backward"] > 0
    # documents at chunk boundaries (8, 24 with C = 4) leave every unit whole or skipped
    cut = window is not None or (documents is not None and documents.offsets[1] % 4 != 0)
    assert (efficient_stand_in.calls["forward"] > 0) == cut


def test_plan_skips_units_from_document_offsets_without_device_syncs():
    """Documents [0, 8), [8, 24), [24, 32) in every row, R = 2 (C = 8): rank 0 (chunks 0, 3)
    computes 2 units, rank 1 (chunks 1, 2) 3; the plan reads only the host offsets, so a
    DocumentMask whose tensor would sync on every read costs one copy per micro-batch."""
    docs = _documents((8, 24), (0, 1))
    docs.offsets, docs.token_documents()  # the one device->host copy of a micro-batch
    docs.cu_seqlens = None  # any later read of the device tensor would fail
    units = []
    for r in range(2):
        plan = ring_plan(Ring(None, r, 2, 0, 0), 16, documents=docs)
        units.append(sum(len(plan.step(src)) for src in range(2)))
    assert units == [2, 3]


def ring_unit_kernels(device, dtype, head_dim, use_flash_attn) -> tuple[str, str]:
    """The ring's (dense, masked) unit kernels as the one selection chooses them."""
    call = AttentionCall(device, dtype, head_dim, 4, 4, ring=True, use_flash_attn=use_flash_attn)
    units = select(call)
    assert isinstance(units, RingUnits)
    return units.dense.name, units.masked.name


def test_kernel_choice_per_device_and_dtype(flash_attn_stand_in):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert ring_unit_kernels(cpu, torch.float64, 64, False) == ("cpu-flash", "cpu-flash")
    assert ring_unit_kernels(cpu, torch.bfloat16, 64, True) == ("flash-attn", "cpu-flash")
    assert ring_unit_kernels(cpu, torch.float32, 64, True) == ("cpu-flash", "cpu-flash")
    assert ring_unit_kernels(cuda, torch.bfloat16, 64, True) == ("flash-attn", "sdpa-efficient")
    assert ring_unit_kernels(cuda, torch.bfloat16, 264, True) == (
        "sdpa-efficient",
        "sdpa-efficient",
    )
    assert ring_unit_kernels(cuda, torch.float32, 64, False) == ("sdpa-efficient", "sdpa-efficient")
    assert ring_unit_kernels(cuda, torch.float64, 64, False) == ("reference", "reference")
    with pytest.raises(ValueError, match="--kv-channels"):
        ring_unit_kernels(cuda, torch.bfloat16, 36, False)


def test_ring_refuses_a_dense_mask_and_an_odd_local_sequence():
    ring = Ring(None, 0, 2, 1, 1)
    q = torch.randn(6, 1, 2, D)
    with pytest.raises(TypeError, match="DocumentMask"):
        ring_attention(q, q, q, ring, documents=torch.zeros(1, 1, 12, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="even local sequence"):
        ring_attention(q[:5], q[:5], q[:5], ring)
    with measure_ring_time() as times:
        pass
    assert times["forward_blocks"] == 0
