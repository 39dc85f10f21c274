"""The estimator and MFU know MoE: parameters per rank exactly as the built model holds them
(E/EP experts per MoE layer, dense layers between them), an MoE layer's saved bytes within 15%
of what autograd keeps (tools/bench/saved_bytes.py), and the FLOPs per token counted over the
active parameters only, against a count made from the model's own parameter shapes."""

import dataclasses
import functools

import pytest

from megatron_ul.config import ModelConfig
from megatron_ul.pipeline.param_table import parameter_table
from megatron_ul.training import memory_estimator as me
from megatron_ul.training.metrics import flops_per_token
from megatron_ul.training.pretrain import configure
from tests.distributed import run_distributed
from tests.training.test_memory_estimator import BASE, CPU_FP32, LLAMA
from tools.bench.saved_bytes import measure_many

MOE = ["--hidden-dropout", "0", "--num-experts", "4", "--moe-router-topk", "2"] + LLAMA
CASES = {  # name -> (flags, world)
    "moe": (MOE, 1),
    "moe-freq2-shared": (
        MOE + ["--moe-layer-freq", "2", "--moe-shared-expert-intermediate-size", "64"],
        1,
    ),
    "moe-dp2-ep2": (MOE + ["--expert-model-parallel-size", "2", "--global-batch-size", "4"], 2),
}
SLOW = {"moe-dp2-ep2"}  # two ranks: about two minutes on two shared cores


@functools.cache
def measured(world: int) -> dict:
    names = [n for n, (_, w) in CASES.items() if w == world]
    results = run_distributed(measure_many, world, [BASE + CASES[n][0] for n in names])
    return dict(zip(names, results[0]))


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES]
)
def test_moe_estimate_matches_measurement(name):
    flags, world = CASES[name]
    got = measured(world)[name]
    cfg = configure(BASE + flags, world)
    layout = me.layout_from_config(cfg)
    est = me.estimate(cfg.model, layout, precision=CPU_FP32)
    assert est.params_per_rank == got["params"]
    # layer 0 is an MoE layer in every case; the estimate counts every layer as one
    per_layer = me.layer_activation_bytes(cfg.model, layout, CPU_FP32)
    error = abs(per_layer - got["saved"]["layer0"]) / got["saved"]["layer0"]
    saved = got["saved"]["layer0"]
    print(f"{name}: MoE layer measured {saved} estimated {per_layer:.0f} ({error:.1%})")
    assert error < 0.15


def _reference_flops(m: ModelConfig, vocab: int) -> float:
    """3 × 2 FLOPs per multiply-add of every weight a token meets (the top-k of the experts:
    all experts have one shape, so k/E of their weights), plus attention's N×N scores and
    values and the logits; from the parameter table of the model itself."""
    active = 0.0
    for name, entry in parameter_table(m).items():
        if len(entry["shape"]) != 2 or "embeddings" in name or "output_layer" in name:
            continue
        elements = entry["shape"][0] * entry["shape"][1]
        share = m.moe_router_topk / m.num_experts if ".local_experts." in name else 1.0
        active += elements * share
    attention = 2 * 2 * m.seq_length * m.num_attention_heads * m.head_dim * m.num_layers
    return 3.0 * (2 * active + attention + 2 * m.hidden_size * vocab)


@pytest.mark.parametrize(
    "moe",
    [
        ["--num-experts", "8"],
        ["--num-experts", "4", "--moe-router-topk", "1", "--moe-layer-freq", "2"],
        ["--num-experts", "4", "--moe-shared-expert-intermediate-size", "48",
         "--moe-ffn-hidden-size", "40"],
    ],
)  # fmt: skip
def test_flops_count_active_parameters_only(moe):
    m = configure(BASE + LLAMA + ["--num-layers", "4"] + moe, 1).model
    vocab = m.padded_vocab_size(1)
    ours, reference = flops_per_token(m, vocab), _reference_flops(m, vocab)
    print(f"{moe}: {ours:.6g} FLOPs per token, reference {reference:.6g}")
    assert abs(ours - reference) <= 1e-9 * reference, (ours, reference)
    dense = dataclasses.replace(m, num_experts=None)
    assert ours < flops_per_token(dense, vocab) * m.num_experts  # not every expert counted


def test_dry_run_says_the_experts_per_rank_and_the_dispatch():
    from megatron_ul.training.dry_run import describe

    argv = BASE + MOE + ["--num-experts", "8", "--expert-model-parallel-size", "4"]
    text = describe(
        configure(argv + ["--global-batch-size", "8", "--moe-token-dispatcher-type", "alltoall"], 4)
    )
    line = next(x for x in text.splitlines() if x.startswith("experts:"))
    # 512 tokens × top-2 × hidden 64 × 4 bytes, four exchanges, 3/4 of them off the rank
    assert "2 MoE layers of 8 experts" in line and "2 experts per rank" in line, line
    assert f"{4 * 512 * 2 * 64 * 4 * 3 / 4 / 2**20:.1f} MiB" in line, line
