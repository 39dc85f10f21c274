"""A stand-in device for CPU tests that counts device->host synchronisations.

On a CPU run every tensor is host memory, so a `.tolist()` of a device tensor costs nothing and
nothing shows it. `count_host_syncs()` plays the device instead: inside it, a tensor is device
memory unless it is marked as host memory (`HostTensor`, tests/stand_ins/host_memory.py), and
every call that makes the host wait for device memory is recorded with the package function
that made it, and so is every host->device copy (`to` of a host tensor), with its
non_blocking flag.

Host memory, as on a GPU run: what a factory makes without a `device=` argument (torch.tensor,
zeros, arange, ..., and torch.from_numpy) or with a host tensor's device, and everything
computed from host tensors only; `.to(device)` moves a host tensor to the device
(host_memory.py's rule), `.to(dtype)` leaves it on the host. Device memory: the rest
(parameters, anything made with the run's device, everything computed from a device tensor).

What synchronises, read from torch's sources (torch 2.11):
  - a Python scalar or list from a tensor: `item`, `__bool__`, `__float__`, `__int__`,
    `__index__`, `__complex__` (aten `_local_scalar_dense`, which copies and waits), `tolist`
    (torch/csrc/utils/tensor_list.cpp `tensor_to_list`: a blocking copy to the CPU first),
    `numpy`, printing (`__repr__`, `__str__`, `__format__` read the values);
  - a copy to the CPU: `cpu()`, `to("cpu")` (a device->pageable copy is synchronous);
  - ops whose output size depends on the values (the host must read a count before it can
    allocate): `nonzero`, `argwhere`, one-argument `where`, `masked_select`, `unique`,
    `unique_consecutive`, `repeat_interleave` with tensor repeats and no `output_size`, and
    indexing with a boolean tensor (aten/src/ATen/native/cuda/Nonzero.cu, Indexing.cu);
  - comparisons that return a Python bool: `equal`, `allclose`, `is_nonzero`.
One limit of playing a device on the CPU: `to(torch.device("cpu"))` is taken as a move to the
device (the run's device object is the CPU here); only the string "cpu" or `cpu()` leave it.
"""

from __future__ import annotations

import os
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from tests.stand_ins.host_memory import HostTensor, on_host

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "megatron_ul")

Tensor = torch.Tensor
# The device of host memory: one object, so that a factory called with `device=t.device` of a
# host tensor `t` makes host memory too (the run's device is the CPU here as well).
HOST = torch.device("cpu")
DEVICE_OF = Tensor.device.__get__
READS = {
    Tensor.item,
    Tensor.tolist,
    Tensor.__bool__,
    Tensor.__float__,
    Tensor.__int__,
    Tensor.__index__,
    Tensor.__complex__,
    Tensor.numpy,
    Tensor.__repr__,
    Tensor.__str__,
    Tensor.__format__,
    Tensor.cpu,
    Tensor.is_nonzero,
    torch.is_nonzero,
    torch.equal,
    Tensor.equal,
    torch.allclose,
    Tensor.allclose,
}
VALUE_SIZED = {
    torch.nonzero,
    Tensor.nonzero,
    torch.argwhere,
    Tensor.argwhere,
    torch.masked_select,
    Tensor.masked_select,
    torch.unique,
    Tensor.unique,
    torch.unique_consecutive,
    Tensor.unique_consecutive,
}
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.scalar_tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.empty_strided,
}


@dataclass
class HostSyncs:
    """The synchronisations seen, as (step, what, where): `where` is the innermost package
    line (file:function) on the stack, or the caller's when no package code is on it."""

    step: int = 0
    seen: list = field(default_factory=list)
    # host->device copies, as (step, blocking, where): not synchronisations of the device,
    # but a copy from pageable memory, or one without non_blocking, stops the host until done
    copies: list = field(default_factory=list)


def _is_device(value) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, HostTensor)


def _where() -> str:
    frames = traceback.extract_stack()[:-2]  # less this function and the mode's
    inside = [f for f in frames if f.filename.startswith(PACKAGE)]
    frame = (inside or frames)[-1]
    return f"{os.path.relpath(frame.filename, os.path.dirname(PACKAGE))}:{frame.name}"


def _target(args, kwargs):
    """The device a `Tensor.to` call names, or None."""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return target if isinstance(target, (str, torch.device)) else None


def _syncs(func, args, kwargs) -> str | None:
    """What makes this call a device->host synchronisation, or None."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not any(_is_device(t) for t in tensors):
        return None
    name = getattr(func, "__name__", str(func))
    if func in READS or func in VALUE_SIZED:
        return name
    if func is Tensor.to:
        target = _target(args, kwargs)
        return "to('cpu')" if target is not None and _is_host_device(target) else None
    if func is torch.where and len(args) == 1 and not kwargs:
        return "where(condition)"
    if func in (torch.repeat_interleave, Tensor.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            return "repeat_interleave(tensor repeats)"
    if func in (Tensor.__getitem__, Tensor.__setitem__):
        index = args[1] if len(args) > 1 else None
        items = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items):
            return f"{name} with a boolean index"
    return None


def _is_host_device(device) -> bool:
    """Whether a factory's `device=` names host memory (None: torch's default, the CPU)."""
    return device is None or device is HOST or (isinstance(device, str) and device == "cpu")


class _DeviceMode(TorchFunctionMode):
    def __init__(self, record: HostSyncs):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == DEVICE_OF and isinstance(args[0], HostTensor):
            return HOST
        what = _syncs(func, args, kwargs)
        if what is not None:
            self.record.seen.append((self.record.step, what, _where()))
            if os.environ.get("HOST_SYNC_STACKS"):
                traceback.print_stack()
        result = func(*args, **kwargs)
        if not isinstance(result, Tensor):
            return result
        if func in FACTORIES and _is_host_device(kwargs.get("device")):
            return on_host(result)
        if func is not Tensor.to:
            return result
        target = _target(args, kwargs)
        if target is None and isinstance(args[0], HostTensor):
            return on_host(result)  # a dtype conversion stays where it is
        if target is not None and _is_host_device(target):
            return on_host(result)
        if target is not None and isinstance(args[0], HostTensor):
            blocking = not kwargs.get("non_blocking", False)
            self.record.copies.append((self.record.step, blocking, _where()))
        return result


@contextmanager
def count_host_syncs():
    """Within: device->host synchronisations recorded into the yielded HostSyncs (advance
    its `step` to attribute them to training steps)."""
    record = HostSyncs()
    from_numpy = torch.from_numpy
    torch.from_numpy = lambda array: on_host(from_numpy(array))  # numpy arrays are host memory
    try:
        with _DeviceMode(record):
            yield record
    finally:
        torch.from_numpy = from_numpy
