"""Checkpoints with ZeRO-1 (--use-distributed-optimizer), ZeRO-2, ZeRO-3 (--zero-stage 3, FSDP2) and
the fp16 loss scaler: exact resume on the same layout, and ZeRO optimizer state that loads on
another DP×SP / TP size and with another optimizer (ZeRO state is saved gathered, name-keyed,
like plain AdamW's: checkpoint/layout/zero.py)."""

import pytest

from megatron_ul.optim.precision import GradScaler
from tests.checkpoint.runs import NO_DROPOUT, TINY, assert_bitwise_resume, resume_on_layouts
from tests.checkpoint.zero_runs import (
    SP2,
    TP2_SP2,
    ZERO1,
    ZERO2,
    ZERO3,
    fp16_resume,
    zero_across_layouts,
)
from tests.distributed import run_distributed

LAYOUTS = {
    "ZeRO1-SP2-DP2": ZERO1 + SP2,
    "ZeRO2-SP2-DP2": ZERO2 + SP2,
    "ZeRO3-SP2-DP2": ZERO3 + SP2,
    "ZeRO3-TP2-SP2": ZERO3 + TP2_SP2,
}


@pytest.mark.slow  # default: ZeRO-1 bf16 resume in test_half_precision
def test_zero_resume_is_bitwise_identical(tmp_path):
    results = run_distributed(resume_on_layouts, 4, TINY, LAYOUTS, str(tmp_path))
    assert_bitwise_resume(results, LAYOUTS)


@pytest.mark.slow  # 6 layouts
def test_zero_state_loads_on_other_layouts_and_optimizers(tmp_path):
    out = run_distributed(zero_across_layouts, 4, TINY + NO_DROPOUT, str(tmp_path))[0]
    original = out.pop("original")
    assert len(original) == 6
    diffs = {}
    for name, resumed in out.items():
        expected = original[4:6] if "_from_plain_" in name else original[2:4]
        assert len(resumed) == 2, name
        diffs[name] = max(abs(a - b) for a, b in zip(resumed, expected))
        print(f"{name}: original {expected} resumed {resumed} max diff {diffs[name]:.2e}")
    assert all(d < 1e-5 for d in diffs.values()), diffs


@pytest.mark.slow  # default: fp16 in test_precision
def test_fp16_loss_scaler_is_saved_and_restored(tmp_path):
    # A scale near the fp16 overflow threshold, growing after every good step: the first
    # steps overflow and are skipped, so the scaler's state at iteration 2 differs from a fresh
    # one's, and the restored scaler must equal the saved one.
    argv = (
        TINY
        + ZERO1
        + SP2
        + [
            "--fp16",
            "--initial-loss-scale",
            str(2**22),
            "--hysteresis",
            "1",
            "--loss-scale-window",
            "1",
        ]
    )
    r = run_distributed(fp16_resume, 4, argv, str(tmp_path))[0]
    print(r)
    fresh = GradScaler(2**22, window=1, hysteresis=1).state_dict()
    assert r["saved"]["skipped_steps"] >= 1 and r["saved"] != fresh
    assert r["restored"] == r["saved"]
    assert r["resumed"] == r["full"][2:]


PIPELINES = {
    "ZeRO1-TP2-PP2": ZERO1
    + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "ZeRO1-PP2-interleaved-SP2": ZERO1
    + SP2
    + [
        "--num-layers",
        "4",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
    ],
}


@pytest.mark.slow
def test_zero1_pipeline_resume_is_bitwise_identical(tmp_path):
    """Tied embeddings: the last stage's copy and its Adam moments are gathered too."""
    results = run_distributed(resume_on_layouts, 4, TINY, PIPELINES, str(tmp_path))
    for layout in PIPELINES:
        full, resumed = results[0][layout]
        print(f"{layout}: uninterrupted {full}\n  resumed at 2 {resumed}")
        assert resumed == full[2:], layout


ZERO3_PIPELINES = {
    "ZeRO3-PP2-DP2": ZERO3 + ["--pipeline-model-parallel-size", "2"],
    "ZeRO3-PP2-interleaved-SP2": ZERO3
    + SP2
    + [
        "--num-layers",
        "4",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
    ],
}


@pytest.mark.slow
def test_zero3_pipeline_resume_is_bitwise_identical(tmp_path):
    """FSDP2 per model chunk: each stage's DTensor parameters and moments (the tied embedding
    copy included) are gathered on save and re-sharded on load."""
    results = run_distributed(resume_on_layouts, 4, TINY, ZERO3_PIPELINES, str(tmp_path))
    assert_bitwise_resume(results, ZERO3_PIPELINES)
