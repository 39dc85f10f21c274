"""The memory estimator against what a model really holds on CPU (fp32): parameter count
exactly, parameter + gradient + Adam bytes and the bytes each layer keeps for backward within
15%, single rank, Ulysses SP2 and TP2 with and without Megatron-SP; that Megatron-SP's
column-parallel linears keep only their input shard; plus the GPU-count search."""

import functools

import pytest

from megatron_ul.training import memory_estimator as me
from megatron_ul.training.pretrain import configure
from tests.distributed import run_distributed
from tools.bench.saved_bytes import measure_many

BASE = [
    "--mock-data",
    "--vocab-size",
    "1000",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "256",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "2",
    "--attention-dropout",
    "0",
]
LLAMA = [
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
]
CASES = {  # name -> (flags, world)
    "gpt-dropout-off": (["--hidden-dropout", "0"], 1),
    "gpt-dropout-on": (["--hidden-dropout", "0.1"], 1),
    "llama-gqa-rope": (["--hidden-dropout", "0"] + LLAMA, 1),
    "gpt-sp2": (["--hidden-dropout", "0", "--ds-sequence-parallel-size", "2"], 2),
    "llama-sp2": (["--hidden-dropout", "0", "--ds-sequence-parallel-size", "2"] + LLAMA, 2),
    "gpt-tp2": (["--hidden-dropout", "0", "--tensor-model-parallel-size", "2"], 2),
    "gpt-tp2-megatron-sp": (
        ["--hidden-dropout", "0", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
        2,
    ),
}
# The CPU dropout kernel keeps a float mask (CUDA keeps a bool one).
CPU_FP32 = me.Precision(dropout_mask_bytes=4)


@functools.cache
def measured(world: int) -> dict:
    names = [n for n, (_, w) in CASES.items() if w == world]
    results = run_distributed(measure_many, world, [BASE + CASES[n][0] for n in names])
    return dict(zip(names, results[0]))


@pytest.mark.parametrize("name", list(CASES))
def test_estimate_matches_measurement(name):
    flags, world = CASES[name]
    got = measured(world)[name]
    cfg = configure(BASE + flags, world)
    layout = me.layout_from_config(cfg)
    est = me.estimate(cfg.model, layout, precision=CPU_FP32)
    assert est.params_per_rank == got["params"]
    state = got["param_bytes"] + got["grad_bytes"] + got["optimizer_bytes"]
    est_state = est.parameter_bytes + est.gradient_bytes + est.optimizer_bytes
    assert abs(est_state - state) / state < 0.15
    per_layer = me.layer_activation_bytes(cfg.model, layout, CPU_FP32)
    for layer in ("layer0", "layer1"):
        error = abs(per_layer - got["saved"][layer]) / got["saved"][layer]
        print(
            f"{name} {layer}: measured {got['saved'][layer]} estimated {per_layer:.0f} "
            f"({error:.1%})"
        )
        assert error < 0.15, f"{name} {layer}: {error:.1%} off"
    total = sum(got["saved"].values())
    assert abs(est.activation_bytes - total) / total < 0.15


def test_megatron_sp_linears_keep_only_their_input_shard():
    """TP2: --sequence-parallel must save, per layer, the TP-split norm inputs AND the two
    column-parallel linear inputs (QKV, fc1) as [s/2, b, h] shards. Gathering the linear inputs
    for backward (what F.linear after an all-gather does) would save only the first part."""
    plain, megatron_sp = (measured(2)[n]["saved"] for n in ("gpt-tp2", "gpt-tp2-megatron-sp"))
    s, b, h, tp = 256, 2, 64, 2
    half_sbh_fp32 = s * b * h * 4 * (1 - 1 / tp)
    norm_inputs_saving = 2 * half_sbh_fp32  # the two LayerNorm inputs
    linear_inputs_saving = 2 * half_sbh_fp32  # the QKV and fc1 inputs
    for layer in ("layer0", "layer1"):
        saving = plain[layer] - megatron_sp[layer]
        print(f"{layer}: TP2 {plain[layer]} B, TP2 + --sequence-parallel {megatron_sp[layer]} B")
        assert saving >= norm_inputs_saving + 0.9 * linear_inputs_saving, (layer, saving)


def test_smallest_fitting_layout_grows_ulysses_until_it_fits():
    cfg = configure(
        [
            "--mock-data",
            "--vocab-size",
            "50257",
            "--num-layers",
            "24",
            "--hidden-size",
            "2048",
            "--num-attention-heads",
            "16",
            "--seq-length",
            "131072",
            "--max-position-embeddings",
            "131072",
            "--bf16",
        ],
        1,
    )
    budget = me.memory_budget_bytes(80)
    assert me.estimate_config(cfg).total_bytes > budget  # a 1.2B model at 128K: not one GPU
    found = me.smallest_fitting_layout(cfg, 80)
    assert found is not None
    fitting, est = found
    sp = fitting.parallel.ds_sequence_parallel_size
    assert est.total_bytes <= budget and sp > 1
    assert est.total_bytes == me.estimate_config(fitting).total_bytes
    for smaller in (s for s in range(1, sp) if 16 % s == 0):  # nothing with fewer GPUs fits
        assert me.estimate_config(me.with_layout(cfg, smaller, 1)).total_bytes > budget


def test_zero_and_recompute_shrink_what_they_should():
    cfg = configure(BASE + ["--hidden-dropout", "0"], 1)
    layout = me.Layout(dp=4, sp=2, micro_batch_size=2)
    plain = me.estimate(cfg.model, layout)
    zero3 = me.estimate(cfg.model, layout, zero_stage=3)
    assert zero3.optimizer_bytes == pytest.approx(plain.optimizer_bytes / 8)
    assert zero3.gradient_bytes == pytest.approx(plain.gradient_bytes / 8)
    assert zero3.parameter_bytes == pytest.approx(plain.parameter_bytes / 8)
    full = me.estimate(cfg.model, layout, recompute="full")
    assert full.activation_bytes < plain.activation_bytes


def test_init_peak_and_zero_shards_count_the_ring():
    """ZeRO-3 shards over dp × CP × SP: SP2 × CP2 holds what SP4 holds, at start-up too."""
    cfg = configure(BASE + ["--hidden-dropout", "0"], 1)
    hybrid, ulysses = me.Layout(sp=2, cp=2), me.Layout(sp=4)
    assert me.init_peak_bytes(cfg.model, hybrid, 3) == me.init_peak_bytes(cfg.model, ulysses, 3)
    a = me.estimate(cfg.model, hybrid, zero_stage=3)
    b = me.estimate(cfg.model, ulysses, zero_stage=3)
    assert a.parameter_bytes + a.optimizer_bytes == b.parameter_bytes + b.optimizer_bytes


def test_dry_run_refuses_a_plan_that_does_not_fit_naming_the_largest_term(capsys):
    from megatron_ul.training.pretrain import main

    argv = [
        "--mock-data",
        "--vocab-size",
        "32000",
        "--num-layers",
        "4",
        "--hidden-size",
        "1024",
        "--num-attention-heads",
        "8",
        "--seq-length",
        "262144",
        "--max-position-embeddings",
        "262144",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--position-embedding-type",
        "rope",
        "--dry-run",
    ]
    assert main(argv + ["--gpu-memory-gb", "8"]) == 1
    err = capsys.readouterr().err
    assert "does not fit --gpu-memory-gb 8" in err and "largest term is" in err
    assert main(argv + ["--gpu-memory-gb", "4000"]) == 0
