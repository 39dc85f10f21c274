"""The device bench runs SDPA on views of q, k and v, as CUDA's kernels take them: the same
values as the CPU's contiguous layout copy, and none of that copy's bytes."""

import torch

from megatron_ul.model.attention import local
from tools.bench.bench_layer_floor import sdpa_views_as_on_cuda
from tools.bench.live_tensors import LiveTensorTracker

N, B, H, D = 256, 1, 4, 64


def _attention(q, k, v):
    return local.sdpa_causal(
        q, k, v, backend=None, expand_kv=False, dropout_p=0.0, softmax_scale=None
    )


def _reference(q, k, v):
    """Causal softmax attention in fp64 on [N, b, h, d]."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / D**0.5
    scores = scores.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).permute(2, 0, 1, 3)


def _tracked(q, k, v):
    tracker = LiveTensorTracker(preexisting=(q, k, v))  # their storages are not the op's
    with tracker:
        out = _attention(q, k, v)
    return out, tracker.peak()[1].bytes


def test_views_keep_the_values_and_drop_the_copy():
    torch.manual_seed(0)
    q, k, v = (torch.randn(N, B, H, D, dtype=torch.bfloat16) for _ in range(3))
    copied, copied_peak = _tracked(q, k, v)
    with sdpa_views_as_on_cuda():
        viewed, viewed_peak = _tracked(q, k, v)
    assert local._sdpa_layout(q.permute(1, 2, 0, 3)).is_contiguous()  # restored on exit
    assert torch.equal(viewed, copied)
    torch.testing.assert_close(viewed.double(), _reference(q, k, v), atol=2e-2, rtol=2e-2)
    # The copy path holds q, k and v copied beside the output; the views hold none of them.
    assert copied_peak - viewed_peak == 3 * q.numel() * q.element_size()
