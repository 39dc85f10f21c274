"""ZeRO-1 (--use-distributed-optimizer), ZeRO-2 (--zero-stage 2) and ZeRO-3 (--zero-stage 3,
FSDP2) over dp_cp_sp reproduce the single-process run: per-step loss within 1e-5, final
parameters within 1e-5 relative (fp32, dropout off) — and the Adam state really is split over
the dp_cp_sp ranks."""

import pytest

from megatron_ul.config import ConfigError
from megatron_ul.training.pretrain import configure
from tests.training.equivalence import (
    BASE,
    GPT2_STYLE,
    LLAMA_GQA,
    compare,
    one_process_reference,
    run_layout,
    run_zero_layout,
)

MODELS = {"gpt2-mha-learned": (GPT2_STYLE, 4, 4), "llama-gqa-rope": (LLAMA_GQA, 8, 2)}
LAYOUTS = {  # name -> (flags, world, dp_cp_sp size)
    "SP2-DP2": (["--ds-sequence-parallel-size", "2"], 4, 4),
    "TP2-SP2": (["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "2"], 4, 2),
    "CP2-DP2": (["--context-parallel-size", "2"], 4, 4),
    "TP2-SP2-megatron-sp": (
        [
            "--tensor-model-parallel-size",
            "2",
            "--ds-sequence-parallel-size",
            "2",
            "--sequence-parallel",
        ],
        4,
        2,
    ),
}
STAGES = {
    "zero1": ["--use-distributed-optimizer"],
    # small buckets: several reduce-scatters per micro-batch
    "zero2": ["--zero-stage", "2", "--ddp-bucket-size", "20000"],
    "zero3": ["--zero-stage", "3"],
}
DEFAULT = {  # ZeRO-1: test_half_precision, test_overlap
    ("gpt2-mha-learned", "TP2-SP2", "zero3"),
    ("llama-gqa-rope", "TP2-SP2-megatron-sp", "zero2"),
}


def reference(model: str):
    return one_process_reference(MODELS[model][0])


@pytest.mark.parametrize(
    "model,layout,stage",
    [
        pytest.param(m, lay, st, marks=() if (m, lay, st) in DEFAULT else pytest.mark.slow)
        for m in MODELS
        for lay in LAYOUTS
        for st in STAGES
    ],
)
def test_zero_matches_single_process(model, layout, stage):
    flags, world, dp_cp_sp = LAYOUTS[layout]
    model_flags, heads, groups = MODELS[model]
    losses, params, optimizer_bytes = run_zero_layout(
        BASE + model_flags + flags + STAGES[stage], world
    )
    loss_diff, param_diff = compare(reference(model), (losses, params), heads, groups)
    print(
        f"{model} {layout} {stage}: max loss diff {loss_diff:.2e}, "
        f"max param rel diff {param_diff:.2e}"
    )
    assert loss_diff < 1e-5
    assert param_diff < 1e-5
    if layout == "SP2-DP2":  # no TP: each rank's Adam state is ~1/dp_cp_sp of the whole
        full = 2 * 4 * sum(p.numel() for p in params.values())  # fp32 exp_avg + exp_avg_sq
        for held in optimizer_bytes:
            assert held <= full / dp_cp_sp * 1.05 + 4096, (held, full)


PIPELINES = {  # GPT-2 style (tied embeddings: the last stage's copy is in the optimizer too)
    "PP2-DP2": ["--pipeline-model-parallel-size", "2"],
    "PP2-SP2-interleaved": [
        "--num-layers",
        "4",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--ds-sequence-parallel-size",
        "2",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero1", "zero2"])
@pytest.mark.parametrize("layout", list(PIPELINES))
def test_zero1_and_2_with_pipeline_match_single_process(layout, stage):
    """ZeRO-1/2 shard each pipeline stage's parameters over that stage's dp_cp_sp group; the
    tied embedding's bucket is summed over the stages first."""
    flags = PIPELINES[layout]
    layers = flags[flags.index("--num-layers") :][:2] if "--num-layers" in flags else []
    ref = run_layout(BASE + GPT2_STYLE + layers, 1)
    losses, params, _ = run_zero_layout(BASE + GPT2_STYLE + flags + STAGES[stage], 4)
    loss_diff, param_diff = compare(ref, (losses, params), 4, 4)
    print(f"{stage} {layout}: max loss diff {loss_diff:.2e}, max param rel diff {param_diff:.2e}")
    assert loss_diff < 1e-5 and param_diff < 1e-5


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--zero-stage", "4"], "--zero-stage 4"),
        (["--use-distributed-optimizer", "--zero-stage", "2"], "conflict"),
        (["--use-distributed-optimizer", "--zero-stage", "3"], "conflict"),
    ],
)
def test_bad_zero_flags_are_refused(flags, match):
    with pytest.raises(ConfigError, match=match):
        configure(BASE + GPT2_STYLE + flags, 1)


def test_zero3_with_pipelining_is_accepted():
    cfg = configure(
        BASE + GPT2_STYLE + ["--zero-stage", "3", "--pipeline-model-parallel-size", "2"], 2
    )
    assert cfg.parallel.zero_stage == 3 and cfg.parallel.pipeline_model_parallel_size == 2


def test_zero_stage_1_is_the_distributed_optimizer():
    assert configure(
        BASE + GPT2_STYLE + ["--zero-stage", "1"], 1
    ).parallel.use_distributed_optimizer


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
def test_zero_with_full_recompute_matches_single_process(stage):
    """FSDP2's re-all-gather inside a recomputed layer (and ZeRO-1's views) change nothing."""
    flags, world, _ = LAYOUTS["SP2-DP2"]
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    losses, params, _ = run_zero_layout(
        BASE + GPT2_STYLE + flags + STAGES[stage] + recompute, world
    )
    loss_diff, param_diff = compare(reference("gpt2-mha-learned"), (losses, params), 4, 4)
    assert loss_diff < 1e-5 and param_diff < 1e-5


ZERO3_PIPELINES = {  # name -> (model, flags): the layouts ZeRO-3 (FSDP2) composes with PP
    "gpt2-PP2-DP2": ("gpt2-mha-learned", PIPELINES["PP2-DP2"]),
    "llama-PP2-SP2-interleaved": ("llama-gqa-rope", PIPELINES["PP2-SP2-interleaved"]),
}


@pytest.mark.parametrize(
    "layout",
    [  # the tied-embedding case is fast: cached reference
        pytest.param(name, marks=pytest.mark.slow) for name in ZERO3_PIPELINES
    ],
)
def test_zero3_with_pipeline_matches_single_process(layout):
    """Each model chunk is its own FSDP2 root over its stage's dp_cp_sp group; the schedule's
    several forwards before backwards and the tied embedding's shard all-reduce change
    nothing."""
    model, flags = ZERO3_PIPELINES[layout]
    model_flags, heads, groups = MODELS[model]
    layers = flags[flags.index("--num-layers") :][:2] if "--num-layers" in flags else []
    ref = run_layout(BASE + model_flags + layers, 1) if layers else reference(model)
    losses, params, _ = run_zero_layout(BASE + model_flags + flags + STAGES["zero3"], 4)
    loss_diff, param_diff = compare(ref, (losses, params), heads, groups)
    print(f"ZeRO-3 {layout}: max loss diff {loss_diff:.2e}, max param rel diff {param_diff:.2e}")
    assert loss_diff < 1e-5 and param_diff < 1e-5
