"""The estimator's loss backward against the live-tensor tracker: the tiled logits loss over
a real output weight, bf16 and fp32, every tensor it makes counted (one chunk's logits and
their gradient, the softmax's fp32 row block, the output weight's gradient summed over the
chunks, the final hidden states' gradient)."""

import pytest
import torch

from megatron_ul.model.tiled_loss import tiled_logits_loss
from megatron_ul.training import memory_estimator as me
from megatron_ul.training.pretrain import configure
from tools.bench.live_tensors import LiveTensorTracker

HIDDEN, VOCAB, TOKENS, CHUNK = 64, 4096, 4096, 2048


def _estimate(half: bool) -> float:
    argv = [
        "--mock-data",
        "--num-layers",
        "1",
        "--hidden-size",
        str(HIDDEN),
        "--num-attention-heads",
        "4",
        "--vocab-size",
        str(VOCAB),
        "--seq-length",
        str(TOKENS),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--tiled-loss-chunk-size",
        str(CHUNK),
        "--untie-embeddings-and-output-weights",
    ] + (["--bf16"] if half else [])
    cfg = configure(argv, 1)
    precision = me.Precision(half_model=half)
    stage, hidden_grad = me.loss_backward_terms(cfg.model, me.layout_from_config(cfg), precision)
    return stage + hidden_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_loss_backward_matches_the_tracked_chunk(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, 1, HIDDEN, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS, 1), generator=g)
    with LiveTensorTracker(preexisting=[hidden, weight, labels]) as tracker:
        tracker.phase = "loss"
        loss = tiled_logits_loss(
            lambda x: torch.matmul(x, weight.t()), hidden, labels, VOCAB, CHUNK, 1, None
        )
        loss.backward(torch.ones_like(loss))
    measured = tracker.peaks["loss"].bytes
    estimated = _estimate(dtype == torch.bfloat16)
    assert abs(estimated / measured - 1) < 0.10, (measured / 2**20, estimated / 2**20)
