"""Every parallel layout reproduces the single-process run: per-step loss within 1e-5 and final
parameters within 1e-5 (relative), fp32, same seed and data, dropout off."""

import pytest

from tests.training.equivalence import GPT2_STYLE, LLAMA_GQA, assert_matches_one_process

MODELS = {  # name -> (flags, query heads, kv groups)
    "gpt2-mha-learned": (GPT2_STYLE, 4, 4),
    # 2 kv heads: kv heads per rank < SP for SP4 and for TP2·SP2 -> replicated kv heads
    "llama-gqa-rope": (LLAMA_GQA, 8, 2),
}

LAYOUTS = {
    "TP2": (["--tensor-model-parallel-size", "2"], 2),
    "SP2": (["--ds-sequence-parallel-size", "2"], 2),
    "SP4": (["--ds-sequence-parallel-size", "4"], 4),
    "TP2-SP2": (["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "2"], 4),
    "SP2-DP2": (["--ds-sequence-parallel-size", "2"], 4),
    "TP2-SP2-megatron-sp": (
        [
            "--tensor-model-parallel-size",
            "2",
            "--ds-sequence-parallel-size",
            "2",
            "--sequence-parallel",
        ],
        4,
    ),
}


# The default suite runs SP, TP x SP, Megatron-SP and GQA with replicated kv heads once (data
# parallelism: test_zero_equivalence, test_overlap_grad_reduce); the rest runs with --run-slow.
DEFAULT = {
    ("gpt2-mha-learned", "SP2"),
    ("gpt2-mha-learned", "TP2-SP2-megatron-sp"),
    ("llama-gqa-rope", "TP2-SP2"),
}
MATRIX = [
    pytest.param(
        model,
        layout,
        id=f"{model}-{layout}",
        marks=() if (model, layout) in DEFAULT else pytest.mark.slow,
    )
    for model in MODELS
    for layout in LAYOUTS
]


@pytest.mark.parametrize("model,layout", MATRIX)
def test_layout_matches_single_process(model, layout):
    flags, world = LAYOUTS[layout]
    assert_matches_one_process(f"{model} {layout}", MODELS[model], flags, world)
