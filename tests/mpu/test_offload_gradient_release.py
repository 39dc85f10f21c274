"""The offloaded checkpoint's backward takes the layer output's gradient over (the caller's
handle is emptied) only when nothing else holds it, and its gradients stay bitwise those of
plain autograd."""

from __future__ import annotations

import pytest
import torch

from megatron_ul.mpu import offload

S, H = 64, 16


def _weights(dtype):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(H, m * H, generator=g) / 4).to(dtype).requires_grad_() for m in (4, 4, 2, 2)
    ]


def _layer(w):
    def layer(x):  # a residual "attention" half, then a residual "MLP" half
        x1 = x + torch.relu(x @ w[0]) @ w[1].t()
        return x1 + torch.relu(x1 @ w[2]) @ w[3].t()

    return layer


@pytest.fixture
def taken(monkeypatch):
    """Per backward of _ReleasedGradient: whether it emptied the incoming gradient."""
    seen: list[bool] = []
    inner = offload._ReleasedGradient.backward

    def spy(ctx, grad):
        numel = grad.numel()
        out = inner(ctx, grad)
        seen.append(numel > 0 and grad.numel() == 0 and out.numel() == numel)
        return out

    monkeypatch.setattr(offload._ReleasedGradient, "backward", staticmethod(spy))
    # measured through the spy, as the runs below see the gradient
    monkeypatch.setattr(offload, "_SOLE_HOLDER_USES", offload._sole_holder_uses())
    seen.clear()
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_bitwise_those_of_autograd_and_output_gradient_taken(taken, dtype):
    w = _weights(dtype)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(S, H, generator=g).to(dtype).requires_grad_()
    layer = _layer(w)

    def loss(run):
        return (torch.tanh(run(run(x0 * 1.0))) * 2.0).float().sum()

    def grads(run):  # the reentrant checkpoint accumulates into .grad, as training does
        for t in (x0, *w):
            t.grad = None
        loss(run).backward()
        return [t.grad for t in (x0, *w)]

    want = grads(layer)
    chain: list = []
    offloader = offload.HostOffloader(torch.device("cpu"))
    got = grads(lambda x: offload.offloaded_checkpoint(layer, offloader, chain, x))
    for a, b in zip(got, want):
        assert a is not None and torch.equal(a, b)
    assert taken == [True, True]  # both layers' output gradients were taken over


def test_a_gradient_held_elsewhere_is_left_alone(taken):
    """A hook that keeps the output's gradient, and a gradient the caller passes in and
    still names, are not taken; retain_grad keeps its own copy, so that one is."""
    w = _weights(torch.float32)
    x0 = torch.randn(S, H, requires_grad=True)
    layer = _layer(w)

    def output():
        return offload.offloaded_checkpoint(layer, offload.HostOffloader(x0.device), [], x0 * 1.0)

    kept: list[torch.Tensor] = []
    y = output()
    y.register_hook(kept.append)
    (y * 3.0).sum().backward()
    given = torch.full((S, H), 3.0)
    output().backward(given)
    y = output()
    y.retain_grad()
    (y * 3.0).sum().backward()
    assert taken == [False, False, True]
    for grad in (kept[0], given, y.grad):
        assert grad is not None and torch.equal(grad, torch.full((S, H), 3.0))


def test_output_gradient_not_alive_through_the_attention_half(monkeypatch):
    """Live tensors of one layer backward whose first half (attention-like) is the heavier: one
    residual-sized buffer less when the output's gradient is taken over."""
    from tools.bench.live_tensors import LiveTensorTracker

    n, h = 2048, 16
    g = torch.Generator().manual_seed(0)
    w = [(torch.randn(h, m * h, generator=g) / 8).requires_grad_() for m in (8, 8, 1, 1)]
    layer = _layer(w)
    unit = n * h * 4

    def peak(take: bool) -> float:
        monkeypatch.setattr(offload, "_SOLE_HOLDER_USES", None)
        x0 = torch.randn(n, h, generator=g, requires_grad=True)
        y = offload.offloaded_checkpoint(layer, offload.HostOffloader(x0.device), [], x0 * 1.0)
        if not take:  # counts no gradient can have
            monkeypatch.setattr(offload, "_SOLE_HOLDER_USES", (0, 0, 0))
        loss = (y * 1.0).sum()
        del y
        with LiveTensorTracker(preexisting=[x0, *w]) as tracker:
            tracker.phase = "backward"
            loss.backward()
        return tracker.peaks["backward"].bytes / unit

    kept, taken = peak(False), peak(True)
    assert kept - taken > 0.95, (kept, taken)
