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

from typing import Optional

import torch

from .random import device_rng_get, device_rng_set, get_rng_tracker


class HostOffloader:
    """Moves tensors to host memory and back; one per model, counting what it did."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.counts = {"offloaded": 0, "prefetched": 0, "fetched": 0}

    def offload(self, x: torch.Tensor, previous: Optional["OffloadedTensor"]) -> "OffloadedTensor":
        return OffloadedTensor(self, x, previous)


class OffloadedTensor:
    """A tensor parked in host memory. `previous` is the handle offloaded just before this one
    in the same forward pass: backward needs it next, so fetching this one prefetches it."""

    def __init__(
        self, offloader: HostOffloader, x: torch.Tensor, previous: Optional["OffloadedTensor"]
    ):
        self.offloader, self.previous = offloader, previous
        self.on_device: Optional[torch.Tensor] = None
        self.host: Optional[torch.Tensor]
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
        ctx.autocast = (
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
        )
        with torch.no_grad():
            out = function(x, *args)
        ctx.handle = offloader.offload(x, chain[-1] if chain else None)
        chain.append(ctx.handle)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x = ctx.handle.fetch().detach().requires_grad_(ctx.input_requires_grad)
        device_type = x.device.type
        current = _rng_states(device_type)
        _set_rng_states(ctx.rng, device_type)
        try:
            enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                out = ctx.function(x, *ctx.args)
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
        grad_x = x.grad if ctx.input_requires_grad else None
        return (None, None, None, grad_x) + (None,) * len(ctx.args)


def offloaded_checkpoint(
    function, offloader: HostOffloader, chain: list, x: torch.Tensor, *args
) -> torch.Tensor:
    """function(x, *args) keeping only x, in host memory, for backward's recompute. `chain`
    collects the handles of one forward pass in order (for prefetching)."""
    if not torch.is_grad_enabled():
        return function(x, *args)
    return _OffloadedCheckpoint.apply(function, offloader, chain, x, *args)
