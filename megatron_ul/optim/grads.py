"""Gradient reduction over DP×SP and clipping on one global norm.

Parameters are replicated over the data-parallel, ring and Ulysses ranks, so their gradients are
*summed* over the dp_cp_sp group: the loss each rank backpropagates is already divided by the
number of tokens in the whole global batch (see training/step.py), so the sum is the gradient
of the global token-mean loss, whatever the layout.

The sum runs in buckets (grad_buckets.py), after backward or, with --overlap-grad-reduce,
while backward still runs; both give the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..mpu import host_staging
from ..mpu.comm_stats import record
from ..mpu.parallel_state import ParallelDims
from ..mpu.param_spec import param_spec
from .grad_buckets import BucketLauncher, split_into_buckets

_BUCKET_BYTES = 64 * 2**20


GradOf = Callable[[torch.nn.Parameter], "torch.Tensor | None"]


def reduce_group(p: torch.nn.Parameter, dims: ParallelDims):
    """The group p's gradient sums over: its ParamSpec's `grad_group`, a ParallelDims group
    named without `_group` (dp_cp_sp for dense parameters)."""
    name = param_spec(p).grad_group
    try:
        return getattr(dims, f"{name}_group")
    except AttributeError:
        raise ValueError(
            f"a parameter's ParamSpec names gradient group {name!r}, which ParallelDims "
            f"does not have ({name}_group)"
        ) from None


def all_reduce_coalesced(grads: list[torch.Tensor], group) -> None:
    """Sum `grads` over `group` in a few large flat buffers (one per dtype and bucket), on the
    model's device even for host-held gradients."""
    if dist.get_world_size(group) == 1 or not grads:
        return
    buckets: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for g in grads:
        per_dtype = buckets.setdefault(g.dtype, [[]])
        if sum(t.numel() * t.element_size() for t in per_dtype[-1]) > _BUCKET_BYTES:
            per_dtype.append([])
        per_dtype[-1].append(g)
    for per_dtype in buckets.values():
        for bucket in per_dtype:
            host_staging.all_reduce_flat(bucket, group)


def sharded_like_dense(p: torch.nn.Parameter, dims: ParallelDims) -> bool:
    """Is p replicated over the whole dp_cp_sp group, as ZeRO shards assume? (An expert
    under expert parallelism 1 is: its group holds the same ranks.)"""
    if param_spec(p).grad_group == "dp_cp_sp":
        return True
    return dist.get_world_size(reduce_group(p, dims)) == dist.get_world_size(dims.dp_cp_sp_group)


class DataParallelGradSync:
    """Sums the gradients of `params` over their reduction groups (reduce_group: dp_cp_sp for
    dense parameters) in buckets, and Megatron-SP replicated weights' over TP first, after
    backward or overlapped with it. `grad_of(p)` is the gradient to reduce.

    Buckets follow the reverse parameter order, roughly the order backward produces them, one
    run of buckets per reduction group; `deferred_params` (weights tied across pipeline stages)
    get buckets of their own that are reduced only in `finish`, after the caller has summed
    them over the embedding group."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        max_bucket_elements: int,
        dims: ParallelDims,
        grad_of: GradOf,
        overlap: bool = False,
        deferred_params=(),
    ):
        self.dims, self.grad_of = dims, grad_of
        # A bucket staged through the device (host-held gradients): one at a time.
        self.staged: tuple | None = None
        deferred_ids = {id(p) for p in deferred_params}
        ordered = list(reversed(params))
        by_group: dict[str, list[torch.nn.Parameter]] = {}
        for p in ordered:
            if id(p) not in deferred_ids:
                by_group.setdefault(param_spec(p).grad_group, []).append(p)
        buckets, self.groups = [], []
        for members in by_group.values():
            group = reduce_group(members[0], dims)
            for bucket in split_into_buckets(members, max_bucket_elements):
                buckets.append(bucket)
                self.groups.append(group)
        deferred = [p for p in ordered if id(p) in deferred_ids]
        self.buckets = buckets + ([deferred] if deferred else [])
        if deferred:
            self.groups.append(reduce_group(deferred[0], dims))
        self.in_flight: dict[int, tuple] = {}
        self.launcher = BucketLauncher(
            self.buckets,
            self._launch,
            overlap=overlap and any(dist.get_world_size(g) > 1 for g in self.groups),
            deferred=frozenset(range(len(buckets), len(self.buckets))),
        )

    def start(self, num_micro_batches: int) -> None:
        self.launcher.start(num_micro_batches)

    def _launch(self, i: int) -> None:
        group = self.groups[i]
        with_grad = [(p, g) for p in self.buckets[i] if (g := self.grad_of(p)) is not None]
        sequence_parallel = [g for p, g in with_grad if param_spec(p).sequence_parallel]
        all_reduce_coalesced(sequence_parallel, self.dims.tp_group)
        if dist.get_world_size(group) == 1 or not with_grad:
            return
        grads = [g for _, g in with_grad]
        staged = any(map(host_staging.is_host_held, grads))
        if staged:
            self._retire_staged()  # its device buffer is freed before the next one is made
        flat = host_staging.staged_flat(grads)
        record("all_reduce", flat, group)
        launched = (grads, flat, dist.all_reduce(flat, group=group, async_op=True))
        if staged:
            self.staged = launched
        else:
            self.in_flight[i] = launched

    def _retire_staged(self) -> None:
        if self.staged is not None:
            grads, flat, handle = self.staged
            self.staged = None
            handle.wait()
            host_staging.write_back(grads, flat)

    def finish(self) -> None:
        """Launch what backward has not, wait for every bucket and write the sums back."""
        self.launcher.launch_remaining()
        self._retire_staged()
        for i in sorted(self.in_flight):
            grads, flat, handle = self.in_flight[i]
            handle.wait()
            host_staging.write_back(grads, flat)
        self.in_flight.clear()


def counts_once(p: torch.nn.Parameter, dims: ParallelDims) -> bool:
    """Is this rank the one that counts p in the global norm (no double counting of copies)?"""
    spec = param_spec(p)
    if spec.tied_replica:  # the tied output copy on the last PP stage
        return False
    if spec.tensor_parallel:
        return True
    return dims.tp_rank == 0


# The CPU's fp32 norm adds each vector lane's squares in sequence, 6.5e-4 off over a 16M-element
# gradient; norms of 4096-element rows, summed in fp64, stay within 1e-6 of the exact value (the
# CUDA kernel reduces each 65536-element chunk as a tree: no such drift there).
_CPU_ROW = 4096


def grad_norm(grads: list[torch.Tensor], device: torch.device, groups=()) -> float:
    """L2 norm of `grads` summed over `groups` (all-reduced one after the other); the one
    gradient norm every optimizer uses.

    One pass over each gradient in its own dtype, squares accumulated in fp32 (fp64 gradients:
    fp64), no upcast copy of any gradient: on a GPU one `torch._foreach_norm(..., dtype=fp32)`
    per device and dtype, torch's multi-tensor kernel as Megatron's `multi_tensor_l2norm`
    (ForeachReduceOp.cu, foreach_tensor_norm_cuda: each element read once, only per-chunk fp32
    partial sums kept). The partial norms are squared, summed and reduced in fp64: the sum
    cannot overflow unless one gradient's own norm is beyond fp32 (about 1.8e19, then inf);
    an inf or nan element gives an inf or nan norm. One host sync: the result."""
    sq = square_sum(grads, device)
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
    return math.sqrt(sq.item())


def square_sum(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The fp64 sum of the gradients' squares on `device` (grad_norm's, no host sync)."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for norms in _partial_norms(grads):
        # a host-held gradient's part moves to the device
        sq += norms.double().square().sum().to(device, non_blocking=True)
    return sq


def _partial_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """1-D tensors of norms whose squares add up to the gradients' square sum."""
    parts: list[torch.Tensor] = []
    foreach: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        if g.numel() == 0:
            continue
        g = g.detach()
        pieces = [g]
        if g.device.type == "cpu" and g.is_contiguous() and g.numel() > _CPU_ROW:
            if g.dtype in (torch.float32, torch.float64):  # read in place, row by row
                parts += _row_norms(g.view(-1))
                continue
            # the CPU norm upcasts a half-precision input whole: one piece at a time
            pieces = list(g.view(-1).split(_CPU_ROW))
        # torch's fast path takes one device and one dtype per call
        foreach.setdefault((g.device, g.dtype), []).extend(pieces)
    for same_kind in foreach.values():
        # fp32, or fp64 for fp64 gradients (torch refuses a narrowing dtype)
        accumulate = torch.promote_types(same_kind[0].dtype, torch.float32)
        parts.append(torch.stack(torch._foreach_norm(same_kind, 2, dtype=accumulate)))
    return parts


def _row_norms(flat: torch.Tensor) -> list[torch.Tensor]:
    rows = flat.numel() // _CPU_ROW
    whole = flat[: rows * _CPU_ROW].view(rows, _CPU_ROW)
    return [
        torch.linalg.vector_norm(whole, dim=1),
        torch.linalg.vector_norm(flat[rows * _CPU_ROW :]).reshape(1),
    ]


def global_grad_norm(
    params: list[torch.nn.Parameter], dims: ParallelDims, grad_of: GradOf
) -> float:
    """L2 norm of the whole model's gradient, over the model-parallel (TP×PP) group.

    A parameter reduced over a smaller group than dp_cp_sp (an expert: replicated over its
    expert-data-parallel group, different across the expert-parallel ranks) counts on its
    group's first rank, and those squares are summed over dp_cp_sp."""
    dense = [p for p in params if param_spec(p).grad_group == "dp_cp_sp"]
    other = [p for p in params if param_spec(p).grad_group != "dp_cp_sp"]
    host_staging.wait_for_host_copies()  # the host reads host-held gradients from here on
    # the parameters' device even when this rank counts no gradient (the reduction needs it)
    device = params[0].device
    sq = square_sum(
        [g for p in dense if (g := grad_of(p)) is not None and counts_once(p, dims)], device
    )
    if other:  # the same on every rank of dp_cp_sp (one model structure)
        first = [p for p in other if dist.get_rank(reduce_group(p, dims)) == 0]
        counted = [g for p in first if (g := grad_of(p)) is not None and counts_once(p, dims)]
        extra = square_sum(counted, device)
        if dist.get_world_size(dims.dp_cp_sp_group) > 1:
            dist.all_reduce(extra, group=dims.dp_cp_sp_group)
        sq += extra
    if dist.get_world_size(dims.pp_tp_group) > 1:
        dist.all_reduce(sq, group=dims.pp_tp_group)
    return math.sqrt(sq.item())


def clip_gradients(
    params: list[torch.nn.Parameter], max_norm: float, dims: ParallelDims, grad_of: GradOf
) -> float:
    """Scale all gradients so that their global norm is at most max_norm; returns the norm
    before clipping (what Megatron logs as grad-norm)."""
    norm = global_grad_norm(params, dims, grad_of)
    coeff = clip_coefficient(norm, max_norm)
    if coeff < 1.0:
        for p in params:
            g = grad_of(p)
            if g is not None:
                g.mul_(coeff)
    return norm


def clip_coefficient(norm: float, max_norm: float) -> float:
    """Megatron's clip factor (1.0: no clipping; max_norm 0 never clips)."""
    if max_norm > 0 and math.isfinite(norm):
        return min(1.0, max_norm / (norm + 1e-6))
    return 1.0
