"""Gradient reduction over DP×SP and clipping on one global norm.

Parameters are replicated over data- and sequence-parallel ranks, so their gradients are
*summed* over the dp_cp_sp group: the loss each rank backpropagates is already divided by the
number of tokens in the whole global batch (see training/step.py), so the sum is the gradient
of the global token-mean loss, whatever the layout.

The sum runs in buckets (grad_buckets.py), after backward or, with --overlap-grad-reduce,
while backward still runs; both give the same bits.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..mpu.parallel_state import ParallelDims
from ..mpu.comm_stats import record
from ..mpu.param_spec import param_spec
from ..mpu import host_staging
from . import host_grads
from .grad_buckets import BucketLauncher, bucket_elements, split_into_buckets

_BUCKET_BYTES = 64 * 2**20


def grad_of(p: torch.nn.Parameter):
    """The gradient the optimizer reduces, clips and applies: a half-precision model's fp32
    `main_grad` (optim/mixed_precision.py accumulates into it), else `p.grad`. A host-held
    main_grad no micro-batch wrote this step is zeroed first (host_grads.settle)."""
    main = getattr(p, "main_grad", None)
    if main is None:
        return p.grad
    host_grads.settle(p)
    return main


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


class DataParallelGradSync:
    """Sums the gradients of `params` over dp_cp_sp in buckets (and Megatron-SP replicated
    weights' over TP first), after backward or overlapped with it.

    Buckets follow the reverse parameter order, roughly the order backward produces them;
    `deferred_params` (weights tied across pipeline stages) get buckets of their own that are
    reduced only in `finish`, after the caller has summed them over the embedding group."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        max_bucket_elements: int,
        dims: ParallelDims,
        overlap: bool = False,
        deferred_params=(),
    ):
        self.dims = dims
        # A bucket staged through the device (host-held gradients): one at a time.
        self.staged: tuple | None = None
        deferred_ids = {id(p) for p in deferred_params}
        ordered = list(reversed(params))
        buckets = split_into_buckets(
            [p for p in ordered if id(p) not in deferred_ids], max_bucket_elements
        )
        deferred = [p for p in ordered if id(p) in deferred_ids]
        self.buckets = buckets + ([deferred] if deferred else [])
        self.group = self.dims.dp_cp_sp_group
        self.in_flight: dict[int, tuple] = {}
        self.launcher = BucketLauncher(
            self.buckets,
            self._launch,
            overlap=overlap and dist.get_world_size(self.group) > 1,
            deferred=frozenset(range(len(buckets), len(self.buckets))),
        )

    def start(self, num_micro_batches: int) -> None:
        self.launcher.start(num_micro_batches)

    def _launch(self, i: int) -> None:
        with_grad = [p for p in self.buckets[i] if grad_of(p) is not None]
        sequence_parallel = [grad_of(p) for p in with_grad if param_spec(p).sequence_parallel]
        all_reduce_coalesced(sequence_parallel, self.dims.tp_group)
        if dist.get_world_size(self.group) == 1 or not with_grad:
            return
        grads = [grad_of(p) for p in with_grad]
        staged = any(map(host_staging.is_host_held, grads))
        if staged:
            self._retire_staged()  # its device buffer is freed before the next one is made
        flat = host_staging.staged_flat(grads)
        record("all_reduce", flat, self.group)
        launched = (grads, flat, dist.all_reduce(flat, group=self.group, async_op=True))
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


def reduce_gradients(
    params: list[torch.nn.Parameter], dims: ParallelDims, max_bucket_elements: int | None = None
) -> None:
    """Finish the backward pass without overlap: Megatron-SP replicated weights over TP,
    everything over dp_cp_sp (the groups of `dims`), in the buckets an
    overlapped run would use."""
    if max_bucket_elements is None:
        max_bucket_elements = bucket_elements(None, dims.dp_cp_sp_size)
    DataParallelGradSync(params, max_bucket_elements, dims).finish()


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
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for norms in _partial_norms(grads):
        # a host-held gradient's part moves to the device
        sq += norms.double().square().sum().to(device, non_blocking=True)
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
    return math.sqrt(sq.item())


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


def global_grad_norm(params: list[torch.nn.Parameter], dims: ParallelDims) -> float:
    """L2 norm of the whole model's gradient, over the model-parallel (TP×PP) group."""
    grads = [grad_of(p) for p in params if grad_of(p) is not None and counts_once(p, dims)]
    host_staging.wait_for_host_copies()  # the host reads host-held gradients from here on
    # the parameters' device even when this rank counts no gradient (the reduction needs it)
    return grad_norm(grads, params[0].device, (dims.pp_tp_group,))


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float, dims: ParallelDims) -> float:
    """Scale all gradients so that their global norm is at most max_norm; returns the norm
    before clipping (what Megatron logs as grad-norm)."""
    norm = global_grad_norm(params, dims)
    if max_norm > 0 and math.isfinite(norm):
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            for p in params:
                if grad_of(p) is not None:
                    grad_of(p).mul_(coeff)
    return norm
