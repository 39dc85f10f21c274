"""Training with --attention-block-tiles reproduces the one-process run without tiles: per-step
loss within 1e-5 and final parameters within 1e-5 (relative), fp32, on Ulysses, TP × SP (with
and without Megatron-SP), the ring, ZeRO-3, under full recompute and activation offload; in
bf16 within the half-precision layouts' tolerance."""

import pytest

from tests.training.equivalence import (
    BASE,
    DOCUMENTS,
    GPT2_STYLE,
    LLAMA_GQA,
    assert_matches_one_process,
)
from tests.training.half_precision_runs import max_diffs, run_half
from tests.training.test_half_precision import TOLERANCE

MODELS = {  # name -> (flags, query heads, kv groups)
    "gpt2-mha-learned": (GPT2_STYLE, 4, 4),
    "llama-gqa-rope": (LLAMA_GQA, 8, 2),
    "gpt2-documents": (
        GPT2_STYLE + DOCUMENTS,
        4,
        4,
    ),
}
SP2 = ["--ds-sequence-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]
RECOMPUTE_OFFLOAD = [
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--activation-checkpoint-cpu-offload",
]


def tiles(n: int) -> list[str]:
    return ["--attention-block-tiles", str(n)]


CASES = {  # name -> (model, flags, world); BASE has 32 tokens: 8 per rank under TP2·SP2
    "TP2-SP2-megatron-sp-recompute-offload": (
        "llama-gqa-rope",
        TP2 + SP2 + ["--sequence-parallel"] + RECOMPUTE_OFFLOAD + tiles(4),
        4,
    ),
    "SP2": ("gpt2-mha-learned", SP2 + tiles(4), 2),
    "SP2-gqa-recompute-offload": ("llama-gqa-rope", SP2 + RECOMPUTE_OFFLOAD + tiles(8), 2),
    "SP2-gqa-recompute": ("llama-gqa-rope", SP2 + RECOMPUTE_OFFLOAD[:4] + tiles(2), 2),
    "TP2-SP2": ("llama-gqa-rope", TP2 + SP2 + tiles(2), 4),
    "CP2-documents": ("gpt2-documents", ["--context-parallel-size", "2"] + tiles(4), 2),
    "SP2-CP2": ("llama-gqa-rope", SP2 + ["--context-parallel-size", "2"] + tiles(2), 4),
    "ZeRO3-SP2-DP2": ("llama-gqa-rope", SP2 + ["--zero-stage", "3"] + tiles(4), 4),
}
# The default suite runs Ulysses with GQA, RoPE, full recompute and offload; Megatron-SP's row
# order is checked by tests/model/test_tiled_attention.py, the rest with --run-slow.
DEFAULT = {"SP2-gqa-recompute-offload"}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=() if c in DEFAULT else pytest.mark.slow) for c in CASES],
)
def test_tiled_attention_training_matches_one_process(case):
    model, flags, world = CASES[case]
    assert_matches_one_process(case, MODELS[model], flags, world)


@pytest.mark.slow
def test_tiled_attention_bf16_matches_one_process_in_bf16():
    flags = BASE + LLAMA_GQA
    reference_run = run_half(flags, 1, "bf16")
    tiled = run_half(flags + TP2 + SP2 + ["--sequence-parallel"] + tiles(4), 4, "bf16")
    loss_diff, param_diff = max_diffs(reference_run, tiled)
    print(f"bf16 TP2-SP2-megatron-sp: loss {loss_diff:.2e}, param {param_diff:.2e}")
    loss_tol, param_tol = TOLERANCE["bf16"]
    assert loss_diff < loss_tol and param_diff < param_tol
