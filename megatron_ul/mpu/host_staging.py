"""Collectives over tensors held in host memory for a model on another device (the fp32
gradients optim/host_grads.py keeps on the host): NCCL takes no CPU tensors, so each is staged
through a transient buffer on the model's device, H2D before and D2H after, all non-blocking on
the current stream. `wait_for_host_copies` is the fence before the host reads them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .comm_stats import record

# Streams with device-to-host copies the host has not waited for yet.
_pending_streams: list = []


def mark_host_held(tensor: torch.Tensor, device: torch.device) -> None:
    """`tensor` lives in host memory for a model on `device`: collectives stage it there."""
    # a tag on the tensor itself: it travels wherever the tensor is handed
    tensor.staging_device = device  # type: ignore[attr-defined]


def staging_device(tensor: torch.Tensor):
    """The device a host-held tensor is staged through; None for any other tensor."""
    return getattr(tensor, "staging_device", None)


def is_host_held(tensor: torch.Tensor) -> bool:
    return staging_device(tensor) is not None


def _stream_of(tensor: torch.Tensor):
    """The stream a copy from `tensor` runs on now (None: a CPU copy, done on return)."""
    return torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None


def copied_to_host(device_tensor: torch.Tensor) -> None:
    """Note a non-blocking copy from `device_tensor` to the host, enqueued just now."""
    stream = _stream_of(device_tensor)
    if stream is not None and stream not in _pending_streams:
        _pending_streams.append(stream)


def wait_for_host_copies() -> None:
    """Block until every device-to-host copy noted so far has landed (no-op if none)."""
    while _pending_streams:
        _pending_streams.pop().synchronize()


# ---- staging --------------------------------------------------------------------------------
def staged_flat(grads: list[torch.Tensor]) -> torch.Tensor:
    """`grads` in one flat buffer ready for a collective: the usual flattening, or, when some
    are host-held, H2D copies into a transient buffer on their parameters' device."""
    device = next((staging_device(g) for g in grads if is_host_held(g)), None)
    if device is None:
        return _flatten_dense_tensors(grads)
    flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=device)
    for piece, g in zip(flat.split([g.numel() for g in grads]), grads):
        piece.view_as(g).copy_(g, non_blocking=True)
    return flat


def write_back(grads: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a reduced flat buffer back into `grads` (non-blocking into host memory)."""
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced, non_blocking=True)
    if any(map(is_host_held, grads)):
        copied_to_host(flat)


def all_reduce_flat(grads: list[torch.Tensor], group) -> None:
    """Sum `grads` over `group` in one flat buffer (staged on the model's device when some are
    host-held) and write the sums back."""
    flat = staged_flat(grads)
    record("all_reduce", flat, group)
    dist.all_reduce(flat, group=group)
    write_back(grads, flat)
