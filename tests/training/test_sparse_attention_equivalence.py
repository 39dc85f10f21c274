"""Block-sparse attention on parallel layouts reproduces the one-process run (per-step loss
and final parameters within 1e-5, fp32): each Ulysses rank applies its own global heads'
layout rows, with GQA's replicated kv heads, Megatron-SP, pipeline stages and the ring."""

import pytest

from tests.training.equivalence import (
    GPT2_STYLE,
    LLAMA_GQA,
    assert_matches_one_process,
    one_process_reference,
)

SPARSE = {
    "fixed": ["--sparse-attention", "fixed", "--sparse-block-size", "4",
              "--sparse-num-local-blocks", "2"],
    "bigbird-per-head": ["--sparse-attention", "bigbird", "--sparse-block-size", "4",
                         "--sparse-different-layout-per-head", "--sparse-num-random-blocks", "2"],
}  # fmt: skip
MODELS = {"gpt2": (GPT2_STYLE, 4, 4), "llama-gqa": (LLAMA_GQA, 8, 2)}
LAYOUTS = {
    "SP2": (["--ds-sequence-parallel-size", "2"], 2),
    "SP4": (["--ds-sequence-parallel-size", "4"], 4),
    "TP2-SP2": (["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "2"], 4),
    "TP2-SP2-megatron-sp": (
        ["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "2",
         "--sequence-parallel"],
        4,
    ),
    "PP2-SP2": (["--pipeline-model-parallel-size", "2", "--ds-sequence-parallel-size", "2"], 4),
    "CP2": (["--context-parallel-size", "2"], 2),
    "SP2-CP2": (["--ds-sequence-parallel-size", "2", "--context-parallel-size", "2"], 4),
    "TP2-SP2-CP2-PP2": (
        ["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "2",
         "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        16,
    ),
}  # fmt: skip
CASES = [
    pytest.param("gpt2", "bigbird-per-head", "SP2", id="gpt2-bigbird-per-head-SP2"),
    *(
        pytest.param(
            model, pattern, layout, id=f"{model}-{pattern}-{layout}", marks=pytest.mark.slow
        )  # fmt: skip
        for model, pattern, layout in [
            ("llama-gqa", "bigbird-per-head", "SP4"),  # 2 kv heads < SP 4: replicated
            ("llama-gqa", "fixed", "TP2-SP2"),
            ("gpt2", "fixed", "TP2-SP2-megatron-sp"),
            ("gpt2", "bigbird-per-head", "PP2-SP2"),
            ("gpt2", "bigbird-per-head", "CP2"),
            ("llama-gqa", "bigbird-per-head", "SP2-CP2"),
            ("llama-gqa", "fixed", "TP2-SP2-CP2-PP2"),
        ]
    ),
]


@pytest.mark.parametrize("model,pattern,layout", CASES)
def test_sparse_layout_matches_single_process(model, pattern, layout):
    flags, heads, groups = MODELS[model]
    layout_flags, world = LAYOUTS[layout]
    assert_matches_one_process(
        f"{model} {pattern} {layout}", (flags + SPARSE[pattern], heads, groups), layout_flags, world
    )


def test_the_pattern_changes_the_run():
    """The sparse flags reach the kernel: the one-process losses differ from dense attention's."""
    dense = one_process_reference(GPT2_STYLE)[0]
    sparse = one_process_reference(GPT2_STYLE + SPARSE["bigbird-per-head"])[0]
    assert max(abs(a - b) for a, b in zip(dense, sparse)) > 1e-4
