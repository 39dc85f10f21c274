"""The cross entropy's working set: no fp32 copy and no shifted copy of the logits, only one
block of rows at a time; loss and gradient against an fp64 reference."""

from __future__ import annotations

import pytest
import torch

from megatron_ul.mpu import cross_entropy as ce
from tools.bench.live_tensors import LiveTensorTracker

ROWS, VOCAB, REAL = 96, 1000, 990  # the last 10 columns are padding


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(ROWS, 1, VOCAB, generator=g, dtype=torch.float64)).to(dtype)
    target = torch.randint(0, REAL, (ROWS, 1), generator=g)
    weight = torch.rand(ROWS, 1, generator=g, dtype=torch.float64)
    return logits, target, weight


def _reference(logits, target, weight):
    """fp64 loss and gradient of the same (rounded) logits, the padding columns left out."""
    x = logits.double()[..., :REAL].detach().requires_grad_()
    loss = torch.nn.functional.cross_entropy(
        x.reshape(-1, REAL), target.reshape(-1), reduction="none"
    ).view(target.shape)
    (grad,) = torch.autograd.grad(loss, x, weight)
    return loss.detach(), torch.nn.functional.pad(grad, (0, VOCAB - REAL))


@pytest.mark.parametrize(
    "dtype, loss_tol, grad_tol",
    [
        (torch.float64, 1e-12, 1e-14),
        (torch.float32, 1e-5, 1e-7),
        # the gradient rounds once to the logits' dtype: half an ulp of its largest entries
        (torch.bfloat16, 1e-5, 2**-9),
        (torch.float16, 1e-5, 2**-12),
    ],
)
@pytest.mark.parametrize("block_rows", [7, ROWS])
def test_loss_and_gradient_match_fp64(monkeypatch, dtype, loss_tol, grad_tol, block_rows):
    monkeypatch.setattr(ce, "ROW_BLOCK_ELEMENTS", block_rows * VOCAB)
    logits, target, weight = _inputs(dtype)
    want_loss, want_grad = _reference(logits, target, weight)
    x = logits.clone().requires_grad_()
    loss = ce.vocab_parallel_cross_entropy(x, target, REAL, None)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    loss.backward(weight.to(loss.dtype))
    assert x.grad is not None and x.grad.dtype == dtype
    torch.testing.assert_close(loss.double(), want_loss, rtol=loss_tol, atol=loss_tol)
    torch.testing.assert_close(x.grad.double(), want_grad, rtol=0, atol=grad_tol)
    assert (x.grad[..., REAL:] == 0).all()


def test_bf16_chunk_holds_the_logits_their_gradient_and_one_block(monkeypatch):
    """Alive at the peak of one chunk's forward and backward: the bf16 logits, their bf16
    gradient and one block of fp32 rows. An fp32 upcast and a shifted copy (4 units of the
    bf16 logits, plus the logits) would be 5."""
    monkeypatch.setattr(ce, "ROW_BLOCK_ELEMENTS", ROWS * VOCAB // 8)
    logits, target, weight = _inputs(torch.bfloat16)
    x = logits.requires_grad_()
    unit = x.numel() * x.element_size()
    with LiveTensorTracker(preexisting=[x, target]) as tracker:
        tracker.phase = "chunk"
        loss = ce.vocab_parallel_cross_entropy(x, target, REAL, None)
        loss.backward(weight.float())
    peak = tracker.peaks["chunk"].bytes
    # logits (1) + gradient (1) + one block of 1/8 of the rows in fp32 (1/4) + row vectors
    assert peak < 2.4 * unit, peak / unit
