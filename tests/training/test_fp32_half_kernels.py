"""The memory bench's fp32 stand-in for half-precision CPU kernels: under the live-tensor
tracker it must leave what is tracked unchanged (the same tensors, dtypes and peak bytes) and
compute what the half-precision kernel computes, to its rounding."""

import contextlib

import torch
import torch.nn.functional as F

from tools.bench.fp32_half_kernels import KERNELS, Fp32HalfKernels
from tools.bench.live_tensors import LiveTensorTracker


def attention_block(dtype, wide: bool):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 256, 32, dtype=dtype, requires_grad=True) for _ in range(3))
    w = torch.randn(128, 128, dtype=dtype, requires_grad=True)
    b = torch.randn(128, dtype=dtype, requires_grad=True)
    tracker = LiveTensorTracker()
    seen = []

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else (out,)
            seen.append((func, [o.dtype for o in outs if isinstance(o, torch.Tensor)]))
            return out

    outer = Fp32HalfKernels() if wide else contextlib.nullcontext()
    widened = outer
    with outer, tracker, Record():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = o.transpose(1, 2).reshape(256, 128) @ w
        y = F.linear(y, w, b)
        y = torch.baddbmm(y.view(2, 128, 128), y.view(2, 128, 128), y.view(2, 128, 128))
        y.float().square().mean().backward()
    if wide:  # every matmul and attention kernel, forward and backward, ran in fp32
        assert widened.widened == sum(func in KERNELS for func, _ in seen) >= 8
    return tracker.peak()[1].bytes, seen, [o, y, q.grad, k.grad, w.grad, b.grad]


def test_tracked_tensors_and_peak_are_unchanged_and_values_match():
    peak, seen, values = attention_block(torch.bfloat16, wide=False)
    wide_peak, wide_seen, wide_values = attention_block(torch.bfloat16, wide=True)
    assert wide_peak == peak
    assert wide_seen == seen
    for got, want in zip(wide_values, values):
        assert got.dtype == want.dtype == torch.bfloat16
        scale = want.float().abs().max()
        # A few bf16 ulps: both accumulate in fp32, in different orders.
        assert (got.float() - want.float()).abs().max() <= 2**-6 * scale


def test_fp32_tensors_pass_through_untouched():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with Fp32HalfKernels():
        got = a @ b
    assert torch.equal(got, a @ b)
