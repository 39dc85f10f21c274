"""Measure what a rank actually holds: model-state bytes (parameters, gradients, optimizer
state) and activation bytes saved for backward. Used by tools/bench/bench_memory.py and meant
as the ground truth a memory estimator is checked against.

Bytes are counted per storage, so views (ZeRO-1's parameters are views of one flat buffer,
autograd often saves a view and its base) are counted once; DTensors (ZeRO-3) count their
local shard only.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (t.device.type, s.data_ptr(), s.nbytes())


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: set | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (skipping keys in `exclude`)."""
    seen = set(exclude or ())
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        key = _storage_key(t)
        if key not in seen and key[2] > 0:
            seen.add(key)
            total += key[2]
    return total


def _optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO wrappers keep torch's AdamW here
    return [
        v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    ]


def model_state_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """{'params', 'grads', 'optimizer', 'total'}: bytes this rank holds right now.

    Call it after a step's gradients exist (before zero_grad) to see the gradient share.
    ZeRO-1's reduce-scattered gradient shard counts as gradients.
    """
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    grad_shard = getattr(optimizer, "grad_shard", None)
    if grad_shard is not None:
        grads.append(grad_shard)
    param_keys = {_storage_key(_local(p)) for p in params}
    out = {
        "params": storage_bytes(params),
        "grads": storage_bytes(grads),
        # ZeRO-1's master weights are the model's own storage: do not count them twice.
        "optimizer": storage_bytes(_optimizer_state_tensors(optimizer), exclude=param_keys),
    }
    out["total"] = sum(out.values())
    return out


def saved_activation_bytes(
    fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()
) -> tuple[object, int]:
    """Run fn() and return (its result, bytes of distinct storages autograd saved for backward).

    Pass the model's parameters as `exclude`: weights saved by matmuls are not activations.
    """
    excluded = {_storage_key(_local(t)) for t in exclude}
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor):
        key = _storage_key(_local(t))
        if key not in excluded:
            seen[key] = key[2]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(seen.values())
