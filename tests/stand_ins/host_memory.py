"""A stand-in for host memory apart from the device, for CPU tests: on a CPU run every tensor
is on one device, so code that hands a host tensor to a collective (NCCL takes none) passes.

`HostTensor` marks a buffer as host memory. Like a device, the mark carries over to everything
computed from it (views, flattening, arithmetic: on a GPU those results would be host tensors
too) except what `.to(...)` makes, which is how the code moves a value to its device; a copy
*into* an unmarked (device) tensor leaves that tensor unmarked, as an H2D copy does.
`refuse_host_tensors()` makes torch.distributed's collectives fail on a marked tensor.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

COLLECTIVES = (
    "all_reduce",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "broadcast",
    "all_to_all_single",
)


class HostTensor(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        if func in (torch.Tensor.to, torch.Tensor.copy_) and isinstance(result, cls):
            if func is torch.Tensor.to or type(args[0]) is torch.Tensor:
                return result.as_subclass(torch.Tensor)
        return result


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(HostTensor)


@contextmanager
def refuse_host_tensors():
    originals = {n: getattr(dist, n) for n in COLLECTIVES}

    def checked(name, fn):
        def collective(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            assert not any(isinstance(t, HostTensor) for t in tensors), f"{name} of host memory"
            return fn(*args, **kwargs)

        return collective

    for name, fn in originals.items():
        setattr(dist, name, checked(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
