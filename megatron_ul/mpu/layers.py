"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Every layer computes only this TP rank's slice of its weights, on its device, from the caller's
`init_method` (an mpu.param_init.Init): an element's value depends only on its position in the full
weight, so initialisation is identical for every layout (the single-process run included), which
is what lets the layout-equivalence tests compare parameters directly.

Every parameter's layout is its ParamSpec (mpu/param_spec.py): sharded parameters carry their
`partition_dim`; replicated parameters that see only a TP-chunk of the sequence under
Megatron-SP carry `sequence_parallel=True` (their gradients are summed over TP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .mappings import (
    all_gather,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter,
    reduce_scatter_to_sequence_parallel_region,
)
from .param_init import Constant, Init, new_parameter
from .param_spec import set_param_spec

InitMethod = Init


def tp_slice(full: torch.Tensor, dim: int, stride: int, tp: int, rank: int) -> torch.Tensor:
    """TP rank `rank`'s slice of `full` along `dim`. With stride s, the dimension is s blocks
    laid end to end (e.g. SwiGLU's [gate; up]) and each rank takes its chunk of every block.
    checkpoint/layout/reshard.py uses the same rule to re-split saved weights."""
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(tp, dim=dim)[rank] for b in blocks], dim=dim)


def tp_index(size: int, stride: int, tp: int, rank: int) -> torch.Tensor:
    """Positions along a dimension of `size` that TP rank `rank` holds (see tp_slice)."""
    block, part = size // stride, size // (stride * tp)
    return torch.cat(
        [
            torch.arange(b * block + rank * part, b * block + (rank + 1) * part)
            for b in range(stride)
        ]
    )


def _sharded(
    init: Init,
    shape: tuple,
    dim: int,
    device,
    dtype,
    stride: int = 1,
    vocab_padded: bool = False,
    fused: str | None = None,
    *,
    group,
) -> nn.Parameter:
    """This rank's slice (see tp_slice) over the TP `group` of a `shape` parameter, tagged with
    its partitioning (the ParamSpec that checkpoints and conversions read back)."""
    tp, rank = group_size(group), group_rank(group)
    if shape[dim] % (tp * stride) != 0:
        raise ValueError(
            f"dimension {dim} of size {shape[dim]} is not divisible by TP×stride = {tp}×{stride}"
        )
    index = [torch.arange(n) for n in shape]
    index[dim] = tp_index(shape[dim], stride, tp, rank)
    param = new_parameter(init, shape, tuple(index), device=device, dtype=dtype)
    set_param_spec(
        param, partition_dim=dim, partition_stride=stride, vocab_padded=vocab_padded, fused=fused
    )
    return param


def _zeros(n: int, device, dtype, sequence_parallel: bool) -> nn.Parameter:
    param = new_parameter(Constant(0.0), (n,), device=device, dtype=dtype)
    set_param_spec(param, sequence_parallel=sequence_parallel)
    return param


class _SequenceParallelLinear(torch.autograd.Function):
    """Y = all_gather(X) A^T + b for a Megatron-SP input X [s/TP, b, in], as Megatron-LM's
    LinearWithGradAccumulationAndAsyncCommunication: only the local shard is saved for backward
    (not the gathered [s, b, in], TP× larger); backward gathers it again for the weight
    gradient and reduce-scatters the input gradient (each TP rank holds a partial one)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group = group
        ctx.input_dtype = x.dtype
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(all_gather(x, 0, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group = ctx.group
        total = all_gather(x, 0, group).to(grad.dtype)
        grad_input = grad.matmul(weight.to(grad.dtype)).to(ctx.input_dtype)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_2d.t().mm(total.reshape(-1, total.shape[-1])).to(weight.dtype)
        grad_bias = grad_2d.sum(0).to(weight.dtype) if ctx.has_bias else None
        return reduce_scatter(grad_input, 0, group), grad_weight, grad_bias, None


def sequence_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group
) -> torch.Tensor:
    """F.linear on the all-gathered Megatron-SP input, saving only the local shard."""
    return _SequenceParallelLinear.apply(x, weight, bias, group)


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns (output features) across TP.

    Input: [s, b, in] (with sequence_parallel: [s/TP, b, in], all-gathered here; only the
    shard is kept for backward).
    Output: [s, b, out/TP], or [s, b, out] with gather_output.
    tp_group: the TP group it is split over (the ParallelDims' tp_group; None: one rank).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        init_method: InitMethod,
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        stride: int = 1,
        vocab_padded: bool = False,
        fused: str | None = None,
        device=None,
        dtype=torch.float32,
        tp_group,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.weight = _sharded(
            init_method,
            (output_size, input_size),
            0,
            device,
            dtype,
            stride,
            vocab_padded,
            fused,
            group=tp_group,
        )
        tp = group_size(tp_group)
        if bias:
            self.bias = _sharded(
                Constant(0.0),
                (output_size,),
                0,
                device,
                dtype,
                stride,
                vocab_padded,
                fused,
                group=tp_group,
            )
        else:
            self.register_parameter("bias", None)
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.output_size_per_partition = output_size // tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = sequence_parallel_linear(x, self.weight, self.bias, group=self.tp_group)
        else:
            y = F.linear(
                copy_to_tensor_model_parallel_region(x, self.tp_group), self.weight, self.bias
            )
        return (
            gather_from_tensor_model_parallel_region(y, self.tp_group) if self.gather_output else y
        )


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows (input features) across TP.

    Input: [s, b, in/TP] (already parallel). Output: [s, b, out], summed over TP
    (with sequence_parallel: reduce-scattered to [s/TP, b, out]).
    tp_group: the TP group it is split over (the ParallelDims' tp_group; None: one rank).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        init_method: InitMethod,
        *,
        bias: bool = True,
        sequence_parallel: bool = False,
        device=None,
        dtype=torch.float32,
        tp_group,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.weight = _sharded(
            init_method, (output_size, input_size), 1, device, dtype, group=tp_group
        )
        self.bias = _zeros(output_size, device, dtype, sequence_parallel) if bias else None
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.tp_group)
        # The bias is added after the reduction so that it is counted once.
        return y + self.bias if self.bias is not None else y


def vocab_range(padded_vocab_size: int, group) -> tuple[int, int]:
    """[start, end) of the vocabulary rows held by this rank of the TP `group` (None: one
    rank holds them all)."""
    tp, rank = group_size(group), group_rank(group)
    per = padded_vocab_size // tp
    start = per * rank
    return start, start + per


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows across TP; lookups outside a rank's range
    contribute zero and the partial results are summed over TP."""

    def __init__(
        self,
        padded_vocab_size: int,
        embedding_dim: int,
        init_method: InitMethod,
        *,
        device=None,
        dtype=torch.float32,
        tp_group,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.weight = _sharded(
            init_method,
            (padded_vocab_size, embedding_dim),
            0,
            device,
            dtype,
            vocab_padded=True,
            group=tp_group,
        )
        self.vocab_start, self.vocab_end = vocab_range(padded_vocab_size, tp_group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)
