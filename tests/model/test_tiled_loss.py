"""Tiled output layer + loss: per-token losses and every gradient equal the untiled path
(fp32 within 1e-6) for tied and untied heads, TP (vocab-parallel), Megatron-SP, Ulysses, loss
masks, uneven last chunks; bf16/fp16 autocast within their rounding; PP via a training run."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.model.long_context_harness import LLAMA, MODEL, compare_runs, slow_except
from tests.training.equivalence import BASE, GPT2_STYLE, compare, run_layout

UNTIED = ["--untie-embeddings-and-output-weights"]
TILED = ["--tiled-loss-chunk-size", "5"]  # 32 tokens -> chunks of 5, last one 2


def _single_process_cases(rank, world):
    out = {}
    for name, flags in {"tied": [], "untied": UNTIED, "llama": LLAMA}.items():
        out[name] = compare_runs(rank, world, MODEL + flags, TILED, (1, 1))
    for name, dtype in {"bf16": torch.bfloat16, "fp16": torch.float16}.items():
        out[name] = compare_runs(rank, world, MODEL, TILED, (1, 1), autocast_dtype=dtype)
    return out


def test_tiled_loss_equals_untiled_single_process():
    res = run_distributed(_single_process_cases, 1)[0]
    for name in ("tied", "untied", "llama"):
        assert res[name][0] <= 1e-6 and res[name][1] <= 1e-6, (name, res[name])
    for name in ("bf16", "fp16"):  # same low-precision matmuls per row: rounding-level only
        assert res[name][0] <= 2e-2 and res[name][1] <= 5e-2, (name, res[name])


LAYOUTS = {
    "TP2": (["--tensor-model-parallel-size", "2"], (2, 1)),
    "TP2-megatron-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], (2, 1)),
    "SP2": (["--ds-sequence-parallel-size", "2"], (1, 2)),
}


def _layout_cases(rank, world, layout):
    flags, sizes = LAYOUTS[layout]
    chunk = ["--tiled-loss-chunk-size", "3"]  # 16 (or 8) local tokens, uneven last chunk
    return {
        name: compare_runs(rank, world, MODEL + flags + extra, chunk, sizes)
        for name, extra in {"tied": [], "untied": UNTIED}.items()
    }


@pytest.mark.parametrize("layout", slow_except({"TP2-megatron-sp"}, LAYOUTS))
def test_tiled_loss_equals_untiled_parallel(layout):
    for rank_result in run_distributed(_layout_cases, 2, layout):
        for name, (loss_diff, grad_diff) in rank_result.items():
            assert loss_diff <= 1e-6 and grad_diff <= 1e-6, (layout, name, loss_diff, grad_diff)


@pytest.mark.slow
def test_tiled_loss_pipeline_training_matches_single_process():
    model = BASE + GPT2_STYLE
    ref = run_layout(model, 1)
    pp = run_layout(
        model + ["--pipeline-model-parallel-size", "2", "--tiled-loss-chunk-size", "7"], 2
    )
    loss_diff, param_diff = compare(ref, pp, 4, 4)
    assert loss_diff < 1e-5 and param_diff < 1e-5
