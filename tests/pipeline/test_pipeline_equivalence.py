"""Pipeline layouts reproduce the single-process run: per-step loss within 1e-5 and final
parameters within 1e-5 (relative), fp32, same seed and data, dropout off. Parameters from every
stage are merged under global layer names (tests/training/equivalence.py), and the tied
embedding's last-stage copy must equal the first stage's exactly."""

import functools

import pytest

from tests.training.equivalence import BASE, GPT2_STYLE, LLAMA_GQA, compare, run_layout

MODELS = {  # name -> (flags, query heads, kv groups)
    "gpt2-tied": (GPT2_STYLE, 4, 4),
    "llama-gqa-rope": (LLAMA_GQA, 8, 2),
}
PP2 = ["--pipeline-model-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]
SP2 = ["--ds-sequence-parallel-size", "2"]
FOUR_LAYERS = ["--num-layers", "4"]

# name -> (model, layout flags, world size, layer flags); the reference uses the same layers.
LAYOUTS = {
    "PP2": ("gpt2-tied", PP2, 2, []),
    "PP2-interleaved": (
        "gpt2-tied",
        PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"],
        2,
        FOUR_LAYERS,
    ),
    "TP2-PP2": ("llama-gqa-rope", TP2 + PP2, 4, []),
    "SP2-PP2": ("gpt2-tied", SP2 + PP2, 4, []),
    "TP2-SP2-PP2": ("llama-gqa-rope", TP2 + SP2 + PP2, 8, []),
    "TP2-SP2-PP2-megatron-sp": ("gpt2-tied", TP2 + SP2 + PP2 + ["--sequence-parallel"], 8, []),
    "SP2-PP2-DP2": ("llama-gqa-rope", SP2 + PP2, 8, []),
    "SP2-PP2-interleaved-gqa": (
        "llama-gqa-rope",
        SP2 + PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"],
        4,
        FOUR_LAYERS,
    ),
}
# PP2 and the interleaved schedule alone: tests/pipeline/test_nccl_schedules.py (one process)
DEFAULT = ("TP2-PP2", "SP2-PP2")


@functools.cache
def reference(model: str, layers: tuple):
    return run_layout(BASE + MODELS[model][0] + list(layers), 1)


def check_layout(layout: str) -> None:
    model, flags, world, layers = LAYOUTS[layout]
    model_flags, heads, groups = MODELS[model]
    candidate = run_layout(BASE + model_flags + layers + flags, world)
    loss_diff, param_diff = compare(reference(model, tuple(layers)), candidate, heads, groups)
    print(
        f"{layout} ({model}, {world} ranks): max loss diff {loss_diff:.2e}, "
        f"max param rel diff {param_diff:.2e}"
    )
    assert loss_diff < 1e-5
    assert param_diff < 1e-5


@pytest.mark.parametrize("layout", DEFAULT)
def test_pipeline_layout_matches_single_process(layout):
    check_layout(layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in DEFAULT])
def test_pipeline_layout_matches_single_process_slow(layout):
    check_layout(layout)
