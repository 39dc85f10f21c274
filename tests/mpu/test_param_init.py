"""Shard-only initialisation (mpu/param_init.py): the generator's numbers, its distribution,
and that every layout computes exactly the single-process values while computing only its own
elements."""

import functools
import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from megatron_ul.mpu import param_init
from megatron_ul.mpu.layers import tp_index, tp_slice
from megatron_ul.mpu.param_init import Normal, full_index, standard_normal_at, stream_key
from megatron_ul.mpu.param_spec import param_spec
from megatron_ul.pipeline.model import global_named_parameters
from megatron_ul.training.pretrain import configure, setup
from tests.distributed import run_distributed
from tests.training.equivalence import BASE, GPT2_STYLE, LLAMA_GQA

MASK = (1 << 64) - 1


def _reference_normal(i: int, key: int) -> float:
    """The generator in plain Python integers (no int64 wrap-around to trust)."""
    z = (((i >> 1) + 1) * 0x9E3779B97F4A7C15 + (key & MASK)) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    z ^= z >> 31
    u1, u2 = ((z >> 32) + 1) * 2.0**-32, (z & 0xFFFFFFFF) * 2.0**-32
    angle = u2 * 2 * math.pi - (i & 1) * (math.pi / 2)
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(angle)


def test_generator_matches_plain_integer_arithmetic():
    key = stream_key(1234, "layers.1.mlp.fc1")
    idx = torch.tensor([0, 1, 2, 3, 1_000_001, 2**40 + 7, 2**62 + 3])
    got = standard_normal_at(idx, key)
    want = torch.tensor([_reference_normal(int(i), key) for i in idx], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_distribution_is_normal_with_the_configured_std():
    std, n = 0.02, 1 << 21
    x = Normal(std, 7, "w").values((n,), full_index((n,)), "cpu", torch.float64) / std
    assert abs(float(x.mean())) < 5 / math.sqrt(n)
    assert abs(float(x.std()) - 1) < 3e-3
    assert abs(float(x.pow(4).mean()) - 3) < 0.03  # kurtosis of a normal
    # P(|x| < 1), P(|x| < 2) of N(0, 1)
    assert abs(float((x.abs() < 1).double().mean()) - 0.682689) < 2e-3
    assert abs(float((x.abs() < 2).double().mean()) - 0.954500) < 1e-3
    # Neighbours (the two halves of a Box-Muller pair) and other streams are uncorrelated.
    assert abs(float(torch.corrcoef(torch.stack([x[0::2], x[1::2]]))[0, 1])) < 5e-3
    y = Normal(std, 7, "v").values((n,), full_index((n,)), "cpu", torch.float64) / std
    z = Normal(std, 8, "w").values((n,), full_index((n,)), "cpu", torch.float64) / std
    assert float(torch.corrcoef(torch.stack([x, y, z]))[0, 1:].abs().max()) < 5e-3


@pytest.mark.parametrize("dim,stride", [(0, 1), (1, 1), (0, 2)])
def test_a_shard_is_the_slice_of_the_full_tensor(dim, stride):
    shape, init = (24, 20), Normal(0.02, 3, "p")
    full = init.values(shape, full_index(shape), "cpu", torch.float32)
    for tp in (1, 2, 4):
        for rank in range(tp):
            if shape[dim] % (tp * stride):
                continue
            index = list(full_index(shape))
            index[dim] = tp_index(shape[dim], stride, tp, rank)
            shard = init.values(shape, index, "cpu", torch.float32)
            assert torch.equal(shard, tp_slice(full, dim, stride, tp, rank))
            rows = (index[0][3:7], *index[1:])  # a ZeRO-3 row range of that shard
            assert torch.equal(init.values(shape, rows, "cpu", torch.float32), shard[3:7])


LAYOUTS = {  # name -> (flags, world)
    "TP2": (["--tensor-model-parallel-size", "2"], 2),
    "PP2": (["--pipeline-model-parallel-size", "2"], 2),
    "ZeRO-3 DP2": (["--zero-stage", "3"], 2),
    "TP2-PP2": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4),
    "ZeRO-3 PP2-DP2": (["--zero-stage", "3", "--pipeline-model-parallel-size", "2"], 4),
}
MODELS = {"gpt2": GPT2_STYLE, "llama": LLAMA_GQA}
# Default: the strided TP slices (test_a_shard_is_the_slice_of_the_full_tensor); every layout,
# the tied embedding's last-stage copy and ZeRO-3×PP shards included, with --run-slow.
DEFAULT: set = set()


def _init_on_rank(rank, world, argv):
    computed = []
    original = param_init.standard_normal_at

    def counting(flat, key, buffers=None):
        computed.append(flat.numel())
        return original(flat, key, buffers)

    param_init.standard_normal_at = counting
    try:
        trainer = setup(configure(argv, world))
    finally:
        param_init.standard_normal_at = original
    params, held = {}, 0
    for name, p in global_named_parameters(trainer.model):
        local = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(p.init_spec.init, Normal):
            held += local.numel()
        full = p.full_tensor() if isinstance(p, DTensor) else p
        params[name] = (
            full.detach().clone(),
            param_spec(p).partition_dim,
            param_spec(p).partition_stride,
        )
    return {"params": params, "computed": sum(computed), "held": held}


@functools.cache
def _single_process(model: str) -> dict:
    params = run_distributed(_init_on_rank, 1, BASE + MODELS[model])[0]["params"]
    return {name: value for name, (value, _, _) in params.items()}


@pytest.mark.parametrize(
    "model,layout",
    [
        pytest.param(m, lay, marks=() if (m, lay) in DEFAULT else pytest.mark.slow)
        for m in MODELS
        for lay in LAYOUTS
    ],
)
def test_every_layout_initialises_the_single_process_values_computing_only_its_shard(model, layout):
    argv = BASE + MODELS[model]
    reference = _single_process(model)
    flags, world = LAYOUTS[layout]
    results = run_distributed(_init_on_rank, world, argv + flags)
    for r in results:
        assert r["computed"] == r["held"]  # drew exactly its own elements, nothing more
        for name, (value, dim, stride) in r["params"].items():
            name = name.removeprefix("replica.")
            want = reference[name]
            if dim is not None and value.shape != want.shape:  # a TP shard
                tp = want.shape[dim] // value.shape[dim]
                matches = [
                    torch.equal(value, tp_slice(want, dim, stride, tp, t)) for t in range(tp)
                ]
                assert any(matches), name
            else:
                assert torch.equal(value, want), name
