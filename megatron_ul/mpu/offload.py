"""Activation offload for full recompute (ALST's activation_checkpoint_cpu_offload).

With --recompute-granularity full the only activations a checkpointed run of layers keeps
from forward to backward are its input, [s, b, h] per run. At long N these add up over the
layers (N·h·4 bytes each); offloading moves each to host memory right after the run's forward
and brings it back for the run's recompute in backward.

GPU: the copy to a pinned host buffer runs on a side stream (forward does not wait for it); in
backward, fetching run i's input also starts copying run i-1's input back on the side stream,
so it arrives while run i recomputes and backpropagates. CPU: the tensor already lives in host
memory, so the handle just keeps it; the same control flow (the recompute Function, the
handle chain, the prefetch order) runs, and tests exercise it there.

The checkpoint is an autograd Function that recomputes in backward and calls backward on the
recomputed run itself (the classic reentrant checkpoint, Megatron's CheckpointFunction): torch's
non-reentrant checkpoint holds its inputs by reference, which would keep them on the device.
Dropout replays exactly: the default generator and the RNG tracker's streams are restored for
the recompute, as mpu.recompute does, so results are bit-identical to plain full recompute.
"""

from __future__ import annotations

import sys

import torch

from .random import device_rng_get, device_rng_set, get_rng_tracker


class HostOffloader:
    """Moves tensors to host memory and back; one per model, counting what it did."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.counts = {"offloaded": 0, "prefetched": 0, "fetched": 0}

    def offload(self, x: torch.Tensor, previous: OffloadedTensor | None) -> OffloadedTensor:
        return OffloadedTensor(self, x, previous)


class OffloadedTensor:
    """A tensor parked in host memory. `previous` is the handle offloaded just before this one
    in the same forward pass: backward needs it next, so fetching this one prefetches it."""

    def __init__(self, offloader: HostOffloader, x: torch.Tensor, previous: OffloadedTensor | None):
        self.offloader, self.previous = offloader, previous
        self.on_device: torch.Tensor | None = None
        self.host: torch.Tensor | None
        stream = offloader.stream
        if stream is None:
            self.host = x  # CPU: already host memory, no copy
        else:
            self.host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(x.device))  # x is computed
            with torch.cuda.stream(stream):
                self.host.copy_(x, non_blocking=True)
            x.record_stream(stream)  # x's memory is not reused before the copy ends
            self.copied = torch.cuda.Event()
            self.copied.record(stream)
        offloader.counts["offloaded"] += 1

    def prefetch(self) -> None:
        """Start bringing the tensor back (no-op when already under way or done)."""
        if self.on_device is not None or self.host is None:
            return
        stream = self.offloader.stream
        if stream is None:
            self.on_device = self.host
        else:
            with torch.cuda.stream(stream):
                stream.wait_event(self.copied)
                self.on_device = self.host.to(self.offloader.device, non_blocking=True)
                self.ready = torch.cuda.Event()
                self.ready.record(stream)
        self.offloader.counts["prefetched"] += 1

    def fetch(self) -> torch.Tensor:
        """The tensor on its device (waits for the copy); prefetches the previous handle."""
        self.prefetch()
        x = self.on_device
        assert x is not None, "fetched twice"
        if self.offloader.stream is not None:
            current = torch.cuda.current_stream(self.offloader.device)
            current.wait_event(self.ready)
            x.record_stream(current)  # allocated on the side stream, used here
        self.host = self.on_device = None
        self.offloader.counts["fetched"] += 1
        if self.previous is not None:
            self.previous.prefetch()
        return x


def _rng_states(device_type: str) -> tuple:
    """(CPU generator, tracker streams, CUDA generator or None)."""
    cuda = device_rng_get("cuda") if device_type == "cuda" else None
    return torch.get_rng_state(), get_rng_tracker().get_states(), cuda


def _set_rng_states(states: tuple, device_type: str) -> None:
    torch.set_rng_state(states[0])
    get_rng_tracker().set_states(states[1])
    if states[2] is not None:
        device_rng_set(states[2], "cuda")


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, offloader, chain, x, *args):
        device_type = x.device.type
        ctx.function, ctx.args, ctx.input_requires_grad = function, args, x.requires_grad
        ctx.rng = _rng_states(device_type)
        with torch.no_grad():
            out = function(x, *args)
        ctx.handle = offloader.offload(x, chain[-1] if chain else None)
        chain.append(ctx.handle)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x = ctx.handle.fetch().detach().requires_grad_(ctx.input_requires_grad)
        device_type = x.device.type
        captured: list[torch.Tensor] = []
        current = _rng_states(device_type)
        _set_rng_states(ctx.rng, device_type)
        try:
            with torch.enable_grad():
                inp = _CapturedGradient.apply(x, captured) if ctx.input_requires_grad else x
                out = _ReleasedGradient.apply(ctx.function(inp, *ctx.args))
                del inp
        finally:
            _set_rng_states(current, device_type)
        # Backpropagate from the output's gradient edge, not the output: nothing in backward
        # needs the recomputed output itself ([s, b, h]), so it is freed before backward runs.
        if out.grad_fn is not None:
            edge = torch.autograd.graph.get_gradient_edge(out)
            del out
            torch.autograd.backward(edge, grad_out)
        elif out.requires_grad:
            torch.autograd.backward(out, grad_out)
        grad_x = captured[0] if captured else None
        return (None, None, None, grad_x) + (None,) * len(ctx.args)


class _CapturedGradient(torch.autograd.Function):
    """Identity on the recomputed run's input whose backward keeps the input's gradient in
    `captured` and passes nothing on. Through a leaf's .grad, the residual gradient would be
    cloned (AccumulateGrad copies a gradient that the attention branch still holds) and then
    accumulated into: a second residual-sized buffer for the whole attention backward."""

    @staticmethod
    def forward(ctx, x, captured):
        ctx.captured = captured
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.captured.append(grad)
        return None, None


class _ReleasedGradient(torch.autograd.Function):
    """Identity on the recomputed run's output whose backward hands the output's gradient on
    as a tensor that only the engine holds, and empties the caller's. The layer's last
    residual add passes it on as the inner residual gradient; the engine then sums it and
    the MLP branch's gradient in place into one of the two and frees the other, so one
    residual-sized gradient lives through the attention half, not that sum beside a caller's
    handle kept alive until the whole inner backward ends.

    Taken only when nothing but the engine and this checkpoint's caller reference it (its
    storage has no other tensor and its use counts are those `_sole_holder_uses` measured);
    otherwise passed on as it is. A layer output's gradient is consumed here: a Python name
    that still held it (none in this package) would see an empty tensor afterwards."""

    @staticmethod
    def forward(ctx, out):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        if _PROBE is not None:
            _PROBE.append(_uses(grad))
            return grad
        sole = _SOLE_HOLDER_USES
        if sole is not None and all(n <= m for n, m in zip(_uses(grad), sole)):
            owned = grad.detach()
            grad.set_()  # the caller's handle lets go of the storage
            return owned
        return grad


_PROBE: list | None = None
_SOLE_HOLDER_USES: tuple[int, int, int] | None = None


def _uses(t: torch.Tensor) -> tuple[int, int, int]:
    """(C++ handles on t, tensors on its storage, Python references to t): a view of t, or
    any tensor sharing its memory, adds to the second; a Python name or list keeping it (a
    hook that stored it) to the third. Each count includes this call's own."""
    storage = torch._C._storage_Use_Count(t.untyped_storage()._cdata)
    handles = t._use_count()  # type: ignore[attr-defined]  # torch's stubs omit it
    return handles, storage, sys.getrefcount(t)


def _sole_holder_uses() -> tuple[int, int, int] | None:
    """The use count that a layer output's gradient has in _ReleasedGradient's backward when
    nothing outside autograd holds it (a fresh gradient from the next op), measured once on
    a two-element run: the engine's own references differ between torch releases."""
    global _PROBE
    _PROBE = []
    try:
        x = torch.ones(2, requires_grad=True)
        y = _OffloadedCheckpoint.apply(lambda t: t * 2.0, HostOffloader(x.device), [], x)
        (y * 3.0).sum().backward()
        return _PROBE[0] if _PROBE else None
    finally:
        _PROBE = None


def offloaded_checkpoint(
    function, offloader: HostOffloader, chain: list, x: torch.Tensor, *args
) -> torch.Tensor:
    """function(x, *args) keeping only x, in host memory, for backward's recompute. `chain`
    collects the handles of one forward pass in order (for prefetching)."""
    if not torch.is_grad_enabled():
        return function(x, *args)
    global _SOLE_HOLDER_USES
    if _SOLE_HOLDER_USES is None:
        _SOLE_HOLDER_USES = _sole_holder_uses()
    return _OffloadedCheckpoint.apply(function, offloader, chain, x, *args)
