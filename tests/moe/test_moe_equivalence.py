"""MoE layouts reproduce one process (the layout-equivalence harness, fp32, 1e-5): expert
parallelism from DP, CP and SP ranks, with TP, Ulysses, the ring, PP and ZeRO, both
dispatchers; no token is dropped (no capacity) unless the case says so."""

import pytest

from tests.training.equivalence import LLAMA_GQA, assert_matches_one_process

MOE = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "0.01",
    "--moe-z-loss-coeff",
    "0.001",
    # Clipping on every step: the gradient norm must count each expert once, whatever EP.
    "--clip-grad",
    "0.05",
]
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
# Capacity 0.5: about half the (token, expert) pairs dropped. Each rank applies the capacity
# rule to its own tokens, as megatron-core does; with EP from DP a rank's tokens are one
# process's micro-batch, so the same tokens are dropped.
DROPPING = ["--moe-expert-capacity-factor", "0.5"]
MODELS = {  # name -> (flags, query heads, kv groups)
    "llama-moe": (LLAMA_GQA + MOE, 8, 2),
    "llama-moe-alltoall": (LLAMA_GQA + MOE + ALLTOALL, 8, 2),
}
DROPPING_MODELS = {
    "probs": (LLAMA_GQA + MOE + ALLTOALL + DROPPING, 8, 2),
    "position-padded": (
        LLAMA_GQA
        + MOE
        + DROPPING
        + ["--moe-token-drop-policy", "position", "--moe-pad-expert-input-to-capacity"],
        8,
        2,
    ),
}


def ep(n: int) -> list[str]:
    return ["--expert-model-parallel-size", str(n)]


LAYOUTS = {
    "DP2-EP2": (ep(2), 2),
    "DP4-EP4": (ep(4), 4),
    "DP4-EP2": (ep(2), 4),
    "SP2-EP2": (["--ds-sequence-parallel-size", "2"] + ep(2), 2),
    "TP2-DP2-EP2": (["--tensor-model-parallel-size", "2"] + ep(2), 4),
    "TP2-megatron-sp-DP2-EP2": (
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + ep(2),
        4,
    ),
    "CP2-SP2-EP4": (
        ["--context-parallel-size", "2", "--ds-sequence-parallel-size", "2"] + ep(4),
        4,
    ),
    "PP2-DP2-EP2": (["--pipeline-model-parallel-size", "2"] + ep(2), 4),
    "PP2-interleaved-DP2-EP2": (
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
        + ep(2),
        4,
    ),
}
# Full recomputation re-runs the MoE layers (their dispatch and host read included).
LAYOUTS["DP2-EP2-recompute"] = (
    ep(2) + ["--recompute-granularity", "full", "--recompute-method", "uniform"],
    2,
)
# ZeRO shards over all of DP × CP × SP: with EP 1 the experts are ordinary replicated
# parameters. With EP > 1 ZeRO-1/2 shard the experts' buckets over expert-DP (EP 2 of DP 4:
# two replicas per expert; with Ulysses SP 2 × DP 2 the replicas are SP ranks' pairs).
LAYOUTS.update({f"ZeRO-{stage}-DP2": (["--zero-stage", str(stage)], 2) for stage in (1, 2, 3)})
LAYOUTS.update(
    {f"ZeRO-{stage}-DP4-EP2": (["--zero-stage", str(stage)] + ep(2), 4) for stage in (1, 2, 3)}
)
LAYOUTS.update(
    {
        f"ZeRO-{stage}-SP2-DP2-EP2": (
            ["--zero-stage", str(stage), "--ds-sequence-parallel-size", "2"] + ep(2),
            4,
        )
        for stage in (1, 2, 3)
    }
)
DEFAULT = {
    ("llama-moe-alltoall", "DP2-EP2"),
    ("llama-moe", "SP2-EP2"),
    ("llama-moe-alltoall", "ZeRO-2-DP4-EP2"),
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
def test_moe_layout_matches_single_process(model, layout):
    flags, world = LAYOUTS[layout]
    assert_matches_one_process(f"{model} {layout}", MODELS[model], flags, world)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["probs", "position-padded"])
def test_dropping_matches_single_process(policy):
    assert_matches_one_process(f"dropping {policy} DP2-EP2", DROPPING_MODELS[policy], ep(2), 2)
