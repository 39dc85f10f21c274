"""The lean layer: RMSNorm as one autograd Function (saves its input and the reciprocal RMS
only), LayerNorm's native kernel (input, mean, rstd), and q, k, v split out of the fused QKV
output into owned buffers with one fused-size gradient buffer in backward."""

import weakref

import pytest
import torch
import torch.nn.functional as F

from megatron_ul.model.norms import LayerNorm, RMSNorm, rms_norm
from megatron_ul.model.qkv import split_qkv
from tools.bench.live_tensors import LiveTensorTracker
from tools.bench.saved_bytes import saved_activation_bytes

S, B, H = 64, 2, 256


def _saved_storages(fn, exclude):
    storages = []

    def pack(t):
        storages.append((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    skip = {p.untyped_storage().data_ptr() for p in exclude}
    return out, {ptr: n for ptr, n in storages if ptr not in skip}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_composite_forward_and_backward(dtype):
    torch.manual_seed(0)
    x = torch.randn(S, B, H, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(H, dtype=dtype)).requires_grad_()
    g = torch.randn(S, B, H, dtype=dtype)
    got = [rms_norm(x, w, 1e-5)]
    got += torch.autograd.grad(got[0], (x, w), g)
    want = [F.rms_norm(x, (H,), w, 1e-5)]
    want += torch.autograd.grad(want[0], (x, w), g)
    tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1e-2}[dtype]
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_rms_norm_saves_only_its_input_and_the_reciprocal_rms():
    norm = RMSNorm(H, 1e-5)
    x = torch.randn(S, B, H, requires_grad=True)
    _, saved = _saved_storages(lambda: norm(x), norm.parameters())
    assert sorted(saved.values()) == [S * B * 4, S * B * H * 4]
    # the composite kernel keeps a second [s, b, h] tensor (its normalised input)
    _, composite = _saved_storages(
        lambda: F.rms_norm(x, (H,), norm.weight, 1e-5), norm.parameters()
    )
    assert sum(composite.values()) >= 2 * S * B * H * 4


def _norm_backward(x, w, g, block_elements):
    """(grad x, grad w, the backward's peak of live bytes) with the norm's backward blocks of
    `block_elements` elements."""
    from megatron_ul.model import norms

    saved = norms.BACKWARD_BLOCK_ELEMENTS
    norms.BACKWARD_BLOCK_ELEMENTS = block_elements
    try:
        out = rms_norm(x, w, 1e-5)
        tracker = LiveTensorTracker(preexisting=(x, w, g))  # counted before: not by views
        with tracker:
            grads = torch.autograd.grad(out, (x, w), g)
    finally:
        norms.BACKWARD_BLOCK_ELEMENTS = saved
    return (*grads, tracker.peak()[1].bytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_backward_in_row_blocks_bounds_its_fp32_temporaries(dtype):
    """Blocks of rows: each row's gradient is the same bits as in one block; the weight's
    gradient sums the blocks' fp32 partial sums (rounding of the order only); the fp32
    temporaries shrink from three [rows, h] tensors to three blocks."""
    torch.manual_seed(0)
    rows = 2048
    x = torch.randn(rows, 1, H, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(H, dtype=dtype)).requires_grad_()
    g = torch.randn(rows, 1, H, dtype=dtype)
    one_dx, one_dw, one_peak = _norm_backward(x, w, g, rows * H)
    dx, dw, peak = _norm_backward(x, w, g, 128 * H)  # 16 blocks of 128 rows
    assert torch.equal(dx, one_dx)
    # sums of 2048 terms of order 1, added in another order: fp32 rounding of the sum's size
    rtol, atol = (1e-5, 1e-4) if dtype == torch.float32 else (1e-2, 1e-1)  # bf16: its ulp
    torch.testing.assert_close(dw, one_dw, rtol=rtol, atol=atol)
    fp32_rows = rows * H * 4
    inputs = 2 * rows * H * x.element_size() + H * w.element_size()
    assert one_peak - inputs >= 3 * fp32_rows  # three fp32 [rows, h] temporaries
    # grad x and the blocks' (three fp32 blocks, rstd's and the weight's partial sums)
    assert peak - inputs <= dx.numel() * dx.element_size() + 4 * 128 * H * 4


def test_layer_norm_saves_its_input_mean_and_rstd():
    norm = LayerNorm(H, 1e-5)
    x = torch.randn(S, B, H, requires_grad=True)
    _, saved = _saved_storages(lambda: norm(x), norm.parameters())
    assert sorted(saved.values()) == [S * B * 4, S * B * 4, S * B * H * 4]


def _fused(groups=2, per_group=3, d=16):
    torch.manual_seed(1)
    return torch.randn(S, B, groups * (per_group + 2) * d, requires_grad=True), groups, per_group, d


def test_split_qkv_equals_indexing_and_owns_its_buffers():
    fused, groups, per_group, d = _fused()
    view = fused.view(S, B, groups, per_group + 2, d)
    q, k, v = split_qkv(view, per_group)
    want = (
        view[:, :, :, :per_group].reshape(S, B, groups * per_group, d),
        view[:, :, :, per_group],
        view[:, :, :, per_group + 1],
    )
    for a, b in zip((q, k, v), want):
        assert torch.equal(a, b)
        assert a.is_contiguous()
        assert a.untyped_storage().data_ptr() != fused.untyped_storage().data_ptr()
    grads = [torch.randn_like(t) for t in (q, k, v)]
    got = torch.autograd.grad((q, k, v), fused, grads)[0]
    ref = torch.autograd.grad(want, fused, grads)[0]
    assert torch.equal(got, ref)


def test_split_qkv_backward_builds_one_fused_size_buffer():
    """Indexing's select/slice backward makes a zero-filled fused-size buffer per piece; the
    split writes the three gradients into one."""
    fused, groups, per_group, d = _fused()
    fused_bytes = fused.numel() * 4

    def backward_peak(split):
        q, k, v = split(fused.view(S, B, groups, per_group + 2, d))
        grads = [torch.ones_like(t) for t in (q, k, v)]
        tracker = LiveTensorTracker(preexisting=grads)
        start = tracker.live_bytes
        with tracker:
            tracker.phase = "backward"
            torch.autograd.grad((q, k, v), fused, grads)
        return tracker.peak("backward")[1].bytes - start

    def by_index(view):
        return (
            view[:, :, :, :per_group].reshape(S, B, groups * per_group, d),
            view[:, :, :, per_group],
            view[:, :, :, per_group + 1],
        )

    lean, indexed = backward_peak(lambda t: split_qkv(t, per_group)), backward_peak(by_index)
    assert lean <= 1.05 * fused_bytes < 2 * fused_bytes <= indexed


def test_attention_keeps_no_view_of_the_fused_qkv_output():
    from megatron_ul.mpu.parallel_state import single_rank_dims
    from megatron_ul.mpu.random import model_parallel_seed
    from megatron_ul.training.pretrain import build_model, configure

    cfg = configure(
        [
            "--mock-data",
            "--vocab-size",
            "128",
            "--num-layers",
            "1",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "64",
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "1",
            "--position-embedding-type",
            "rope",
            "--attention-dropout",
            "0",
            "--hidden-dropout",
            "0",
            "--normalization",
            "RMSNorm",
            "--swiglu",
            "--reset-attention-mask",
            "--tokenizer-type",
            "NullTokenizer",
        ],
        1,
    )
    dims = single_rank_dims()
    model_parallel_seed(0, dims)
    model = build_model(cfg, torch.device("cpu"), dims)
    tokens = torch.randint(0, 127, (1, 64))
    positions = torch.arange(64).unsqueeze(0)
    fused_bytes = 64 * 3 * 64 * 4
    outputs = []  # a weak reference: a view saved for backward would keep it alive
    hook = model.layers[0].attention.qkv.register_forward_hook(
        lambda _m, _i, out: outputs.append(weakref.ref(out))
    )
    loss, saved = _saved_storages(
        lambda: model(tokens, positions, None, tokens), model.parameters()
    )
    hook.remove()
    assert outputs and outputs[0]() is None, "the fused QKV output is kept for backward"
    assert fused_bytes not in saved.values()
    del loss
    total = saved_activation_bytes(
        lambda: model(tokens, positions, None, tokens), model.parameters()
    )[1]
    assert total > 0


@pytest.fixture
def rng_tracker():
    from megatron_ul.mpu.random import MODEL_PARALLEL_RNG, get_rng_tracker

    get_rng_tracker().reset()
    get_rng_tracker().add(MODEL_PARALLEL_RNG, 5)


def _one_document(n, heads, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(n, 1, heads, 16, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)
    ]


def test_document_backward_in_tiles_equals_one_call_per_document(monkeypatch, rng_tracker):
    """Tiled in-place gradients equal the per-document backward of SDPA (fp64), with uneven
    tiles over documents of several lengths, one of them a single token."""
    from megatron_ul.model.attention import documents as da
    from megatron_ul.model.attention.layer import document_attention

    offsets = torch.tensor([0, 1, 23, 60, 64], dtype=torch.int32)
    q, k, v = _one_document(64, 4, torch.float64)
    w = torch.randn(64, 1, 4, 16, dtype=torch.float64)

    def grads():
        out = document_attention(
            q, k, v, backend="sdpa", dropout_p=0.0, documents=da.DocumentMask(offsets, 1)
        )
        return torch.autograd.grad((out * w).sum(), (q, k, v))

    monkeypatch.setattr(da, "_writes_in_place", lambda *args: False)
    want = grads()
    monkeypatch.undo()
    monkeypatch.setattr(da, "DOCUMENT_GRAD_TILE", 5)
    for name, a, b in zip("qkv", grads(), want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_document_backward_holds_no_whole_document_gradients(rng_tracker):
    """A single 4096-token document's backward: dq, dk, dv accumulators, the recomputed output
    and tile-sized pieces; the per-document path also held the document's own dq, dk, dv."""
    from megatron_ul.model.attention import documents as da
    from megatron_ul.model.attention.layer import document_attention

    n = 4096
    q, k, v = _one_document(n, 4, torch.float32)
    unit = q.numel() * 4
    offsets = torch.tensor([0, n], dtype=torch.int32)
    out = document_attention(
        q, k, v, backend="sdpa", dropout_p=0.0, documents=da.DocumentMask(offsets, 1)
    )
    grad = torch.ones_like(out)
    with LiveTensorTracker(preexisting=[q, k, v, out, grad]) as tracker:
        tracker.phase = "backward"
        out.backward(grad)
    # q, k, v, out, its gradient, three accumulators, the recomputed output: 9 units, plus
    # tiles; holding the document's gradients next to the accumulators would be 12
    assert tracker.peaks["backward"].bytes < 10 * unit, tracker.peaks["backward"].bytes / unit
