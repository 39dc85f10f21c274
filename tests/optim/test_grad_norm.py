"""The gradient norm every optimizer logs and clips with (plain DP, ZeRO-1, ZeRO-3): fp32
accumulation in one pass over the gradients, equal to an fp64 norm of the whole model's
gradient to fp32 rounding, and no upcast copy of any gradient while it is computed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_ul.model.chunks import model_dims
from megatron_ul.mpu.param_spec import param_spec
from megatron_ul.optim import grads as grads_module
from megatron_ul.optim.distributed_optimizer import DistributedOptimizer
from megatron_ul.optim.grads import grad_norm
from megatron_ul.optim.zero3 import Zero3Optimizer
from megatron_ul.pipeline.model import global_named_parameters
from megatron_ul.training import step as step_module
from megatron_ul.training.pretrain import configure, setup
from tests.distributed import run_distributed
from tests.training.equivalence import BASE, GPT2_STYLE, LLAMA_GQA, merge_tp_shards

# fp32 sums of squares against the exact (fp64) sum: measured 3e-9 (fp32) and 5e-7 (bf16) over
# a 16M-element gradient; the old fp32 CPU norm without pieces was 6.5e-4 off.
RTOL = 2e-6


def _fp64_norm(tensors) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_norm_of_gradients_matches_fp64(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [((32000, 512), 1e-3), ((512,), 1.0), ((1536, 512), 0.1), ((0,), 1.0), ((7,), 100.0)]
    grads = [(torch.randn(s, generator=g) * scale).to(dtype) for s, scale in shapes]
    grads.append(torch.randn(64, 96, generator=g).to(dtype).t())  # not contiguous
    for subset in (grads, grads[:1]):  # the embedding alone: its own summation error
        got = grad_norm(subset, torch.device("cpu"))
        want = _fp64_norm(subset)
        assert abs(got / want - 1) < RTOL, (dtype, got, want)


def test_inf_and_nan_gradients_give_inf_and_nan():
    finite = torch.ones(10_000)
    assert grad_norm([finite, torch.tensor([1.0, math.inf])], torch.device("cpu")) == math.inf
    assert math.isnan(grad_norm([finite, torch.tensor([math.nan, 1.0])], torch.device("cpu")))
    assert math.isnan(grad_norm([torch.tensor([math.inf, -math.inf, math.nan])], finite.device))
    assert grad_norm([], torch.device("cpu")) == 0.0


class _NewStorages(TorchDispatchMode):
    """The bytes of the largest storage an op creates (views and in-place results excluded)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _watch(owner, name: str, mode: _NewStorages) -> None:
    inner = getattr(owner, name)

    def watched(*args, **kwargs):
        with mode:
            return inner(*args, **kwargs)

    setattr(owner, name, watched)


def _full_gradient(optimizer, p: torch.nn.Parameter) -> torch.Tensor:
    g = optimizer.states.grad(p)  # ZeRO-3: p.grad, a DTensor
    return g.full_tensor() if isinstance(g, DTensor) else g


def _gather_zero1_gradients(optimizer) -> None:
    """ZeRO-1 holds the reduced gradient only in each rank's owned slices: fill the rest of the
    buffer from the other ranks (every parameter's gradient view then is the full sum)."""
    buffer = optimizer.grad_buffer
    for (lo, hi), (own_lo, own_hi) in zip(optimizer.bucket_ranges, optimizer.shard_ranges):
        pieces = list(buffer[lo:hi].chunk(optimizer.size))
        dist.all_gather(pieces, buffer[own_lo:own_hi].clone(), group=optimizer.group)
        buffer[lo:hi].copy_(torch.cat(pieces))


def norm_and_gradients(rank: int, world: int, argv: list[str]) -> dict:
    """One training step without clipping: the norm it reports, every gradient it held
    (this rank's TP shards, from DP/CP/SP coordinate 0), and the largest tensor the norm's
    computation created against the largest gradient."""
    trainer = setup(configure(argv + ["--clip-grad", "0"], world))
    model, optimizer = trainer.model, trainer.optimizer
    dims = model_dims(model)
    watch = _NewStorages()
    if isinstance(optimizer, DistributedOptimizer):  # ZeRO-1: the norm, not the reduce-scatter
        _watch(optimizer, "_global_norm", watch)
    elif isinstance(optimizer, Zero3Optimizer):
        _watch(optimizer, "reduce_and_clip", watch)
    else:  # the replicated kinds: the norm and clipping after the all-reduce
        _watch(grads_module, "global_grad_norm", watch)
    shards: dict = {}
    largest_gradient = [0]

    def collect():
        if isinstance(optimizer, DistributedOptimizer):
            _gather_zero1_gradients(optimizer)
        for name, p in global_named_parameters(model):
            local = optimizer.grad(p)
            largest_gradient[0] = max(largest_gradient[0], local.numel() * local.element_size())
            full = _full_gradient(optimizer, p).detach().clone()  # a collective under ZeRO-3
            spec = param_spec(p)
            shards[name] = (full, spec.partition_dim, spec.partition_stride)

    _watch(optimizer, "step", _Before(collect))
    _, norm = step_module.train_step(model, optimizer, next(trainer.train_batches), clip_grad=0.0)
    return {
        "norm": norm,
        "tp_rank": dims.tp_rank,
        "shards": shards if dims.dp_cp_sp_rank == 0 else {},
        "largest_new": watch.largest,
        "largest_gradient": largest_gradient[0],
    }


class _Before:
    """A context manager that runs `fn` on entry (optimizer.step: the gradients as clipped)."""

    def __init__(self, fn):
        self.fn = fn

    def __enter__(self):
        self.fn()

    def __exit__(self, *exc):
        return False


TP2 = ["--tensor-model-parallel-size", "2"]
SP2 = ["--ds-sequence-parallel-size", "2"]
LAYOUTS = {  # name -> (flags, world); every one holds TP-replicated parameters or a tied copy
    "TP2-PP2-megatron-sp-tied": (
        GPT2_STYLE + TP2 + ["--pipeline-model-parallel-size", "2", "--sequence-parallel"],
        4,
    ),
    "zero1-TP2-SP2-megatron-sp-bf16": (
        LLAMA_GQA + TP2 + SP2 + ["--sequence-parallel", "--use-distributed-optimizer", "--bf16"],
        4,
    ),
    "zero3-TP2-SP2": (GPT2_STYLE + TP2 + SP2 + ["--zero-stage", "3"], 4),
    "zero1-PP2-DP2-tied": (
        GPT2_STYLE + ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
        4,
    ),
    "zero3-DP2-bf16": (LLAMA_GQA + ["--zero-stage", "3", "--bf16"], 2),
}
DEFAULT = {"TP2-PP2-megatron-sp-tied", "zero1-TP2-SP2-megatron-sp-bf16", "zero3-TP2-SP2"}


@pytest.mark.parametrize(
    "layout",
    [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in LAYOUTS],
)
def test_reported_norm_is_the_whole_models_gradient_norm(layout):
    """The norm a layout reports equals the fp64 norm of its full gradient (TP shards merged,
    TP-replicated parameters and the tied copy once), and computing it makes no tensor a
    quarter the size of the largest gradient (the old per-parameter fp64 copy: twice it)."""
    flags, world = LAYOUTS[layout]
    results = run_distributed(norm_and_gradients, world, BASE + flags)
    full = merge_tp_shards(results)
    want = _fp64_norm(full.values())
    for r in results:
        assert abs(r["norm"] / want - 1) < RTOL, (layout, r["norm"], want)
        assert r["largest_new"] < r["largest_gradient"] / 4, (layout, r)
