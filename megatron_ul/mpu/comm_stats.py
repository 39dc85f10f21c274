"""Optional byte counting for every collective we issue (used by the communication benchmark).

Counting is off by default and costs one branch per collective when off.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist

_counts: dict | None = None


def record(op: str, tensor: torch.Tensor, group) -> None:
    """Record the bytes this rank sends in one collective (the usual ring/pairwise estimates)."""
    if _counts is None:
        return
    world = dist.get_world_size(group)
    nbytes = tensor.numel() * tensor.element_size()
    if op == "all_to_all":  # keeps 1/world of the buffer, sends the rest
        sent = nbytes * (world - 1) / world
    elif op in ("all_gather", "reduce_scatter"):  # tensor is the full (gathered) buffer
        sent = nbytes * (world - 1) / world
    elif op == "all_reduce":  # ring: reduce-scatter + all-gather
        sent = 2 * nbytes * (world - 1) / world
    else:
        sent = nbytes
    _counts[op]["calls"] += 1
    _counts[op]["bytes"] += sent


@contextmanager
def count_communication():
    """with count_communication() as c: ...; c[op] == {'calls': n, 'bytes': b} sent by this rank."""
    global _counts
    previous, _counts = _counts, defaultdict(lambda: {"calls": 0, "bytes": 0.0})
    try:
        yield _counts
    finally:
        _counts = previous
