"""Autograd-aware collectives: each forward op's backward is its communication dual.

Tensor parallel (TP):       copy <-> all-reduce, split(last dim) <-> all-gather(last dim)
Megatron-SP (TP group, dim 0): split <-> all-gather, all-gather <-> reduce-scatter
Ulysses (SP group):         all-to-all(scatter heads, gather sequence) <-> its inverse
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..timers import NO_TIMERS, Timers
from .comm_stats import record


def group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def group_rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    record("all_reduce", x, group)
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world != 0:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} into {world} equal parts")
    rank = dist.get_rank(group)
    # A copy, not a view: a dim-0 chunk is already contiguous, and a view saved for backward
    # (e.g. by the first norm under Megatron-SP) would keep the whole unsplit tensor alive.
    return x.chunk(world, dim=dim)[rank].clone(memory_format=torch.contiguous_format)


def all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    record("all_gather", out, group)
    dist.all_gather_into_tensor(out, x, group=group)
    return out.movedim(0, dim).contiguous() if dim != 0 else out


def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    if x.shape[0] % world != 0:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[0]} over {world} ranks")
    out = torch.empty((x.shape[0] // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    record("reduce_scatter", x, group)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out.movedim(0, dim).contiguous() if dim != 0 else out


def all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group, timers: Timers = NO_TIMERS
) -> torch.Tensor:
    """Split `x` into world chunks along scatter_dim, send chunk j to rank j, and concatenate
    the chunks received along gather_dim (in rank order). Not autograd-aware; see
    `ulysses_all_to_all`. The exchange counts as the "all-to-all" phase of `timers`."""
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[scatter_dim] % world != 0:
        # An equal-split all-to-all would not complain; it would silently compute garbage.
        raise ValueError(
            f"all-to-all: dim {scatter_dim} of size {x.shape[scatter_dim]} "
            f"is not divisible by the group size {world}"
        )
    # [world, ...chunk] so that chunk j is contiguous block j of the send buffer (no copy when
    # scatter_dim is 0 and x is contiguous).
    send = x.unflatten(scatter_dim, (world, -1)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    record("all_to_all", send, group)
    with timers("all-to-all"):
        dist.all_to_all_single(recv, send, group=group)
    # Chunks from ranks 0..world-1 laid end to end along gather_dim (a view when it is 0).
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


# ---- autograd functions --------------------------------------------------------------------------
# Each takes its group as an argument and keeps it for backward.
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, g.dim() - 1, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, g):
        return _split(g, -1, ctx.group), None


class _ScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, 0, ctx.group), None


class _GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tensor_parallel_output_grad, group):
        ctx.tensor_parallel_output_grad, ctx.group = tensor_parallel_output_grad, group
        return all_gather(x, 0, group)

    @staticmethod
    def backward(ctx, g):
        # If the consumer is tensor-parallel each rank holds a partial gradient: reduce-scatter.
        # Otherwise every rank holds the full gradient: just keep our slice.
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter(g, 0, ctx.group), None, None
        return _split(g, 0, ctx.group), None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, 0, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, 0, ctx.group), None


class _UlyssesAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, timers):
        ctx.dims, ctx.group, ctx.timers = (scatter_dim, gather_dim), group, timers
        return all_to_all(x, scatter_dim, gather_dim, group, timers)

    @staticmethod
    def backward(ctx, g):
        scatter_dim, gather_dim = ctx.dims
        # The inverse all-to-all: scatter what was gathered, gather what was scattered.
        return all_to_all(g, gather_dim, scatter_dim, ctx.group, ctx.timers), None, None, None, None


# ---- public API ----------------------------------------------------------------------------------
# As in Megatron-core, every function takes its group (from the ParallelDims it was handed);
# None is a grid of one rank (parallel_state.single_rank_dims): the op is the identity.
def copy_to_tensor_model_parallel_region(x, group):
    return _CopyToTP.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group):
    return _ReduceFromTP.apply(x, group)


def scatter_to_tensor_model_parallel_region(x, group):
    return _ScatterToTP.apply(x, group)


def gather_from_tensor_model_parallel_region(x, group):
    return _GatherFromTP.apply(x, group)


def scatter_to_sequence_parallel_region(x, group):
    """Megatron-SP: keep this TP rank's chunk of the sequence (dim 0)."""
    return _ScatterToSequenceParallel.apply(x, group)


def gather_from_sequence_parallel_region(x, tensor_parallel_output_grad: bool = True, *, group):
    """Megatron-SP: all-gather the sequence (dim 0) across TP."""
    return _GatherFromSequenceParallel.apply(x, tensor_parallel_output_grad, group)


def reduce_scatter_to_sequence_parallel_region(x, group):
    """Megatron-SP: sum partial results across TP and keep this rank's sequence chunk."""
    return _ReduceScatterToSequenceParallel.apply(x, group)


def ulysses_all_to_all(x, scatter_dim: int, gather_dim: int, group, timers: Timers = NO_TIMERS):
    """DeepSpeed-Ulysses all-to-all over the SP group; backward is the inverse all-to-all.

    Sequence-sharded -> head-sharded: scatter_dim = heads, gather_dim = sequence.
    Head-sharded -> sequence-sharded: the reverse. Both directions are timed as "all-to-all".
    """
    if group_size(group) == 1:
        return x
    return _UlyssesAllToAll.apply(x, scatter_dim, gather_dim, group, timers)
