"""--fused-layers (torch.compile per transformer layer) trains like the eager layers: per-step
loss and final parameters within 1e-5 (fp32) on each layout, with the Ulysses all-to-all and
TP's collectives left outside the compiled regions. The default run uses the aot_eager backend
(dynamo tracing, graph breaks and AOT autograd, without inductor's C++ compilation, which takes
minutes on 2 cores); inductor runs on every layout with --run-slow."""

import functools

import pytest

from tests.training.equivalence import BASE, DOCUMENTS, GPT2_STYLE, LLAMA_GQA, compare, run_layout

MODELS = {"gpt2": (GPT2_STYLE, 4, 4), "llama": (LLAMA_GQA, 8, 2)}
LAYOUTS = {  # name -> (flags, world)
    "single": ([], 1),
    "SP2": (["--ds-sequence-parallel-size", "2"], 2),
    "TP2-megatron-SP": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
    "PP2": (["--pipeline-model-parallel-size", "2"], 2),
    "SP2-full-recompute": (
        [
            "--ds-sequence-parallel-size",
            "2",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
        ],
        2,
    ),
    "SP2-selective-recompute": (
        ["--ds-sequence-parallel-size", "2", "--recompute-granularity", "selective"],
        2,
    ),
    "ZeRO-3 SP2": (["--ds-sequence-parallel-size", "2", "--zero-stage", "3"], 2),
    "CP2-ring": (["--context-parallel-size", "2"], 2),
    # The long-context features (docs/long_context.md): documents with a sliding window in the
    # (eager) attention core, the tiled MLP inside the compiled layer, the tiled loss after it.
    "SP2-long-context": (
        [
            "--ds-sequence-parallel-size",
            "2",
            *DOCUMENTS,
            "--window-size",
            "8",
            "0",
            "--tiled-mlp-chunk-size",
            "4",
            "--tiled-loss-chunk-size",
            "4",
        ],
        2,
    ),
    "SP2-offloaded-recompute": (
        [
            "--ds-sequence-parallel-size",
            "2",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--activation-checkpoint-cpu-offload",
        ],
        2,
    ),
}
DEFAULT = {("llama", "SP2-full-recompute", "aot_eager")}
SHORT = ["--train-iters", "3"]


@functools.cache
def eager(model: str, layout: str):
    flags, world = LAYOUTS[layout]
    return run_layout(BASE + MODELS[model][0] + SHORT + flags, world)


@pytest.mark.parametrize(
    "model,layout,backend",
    [
        pytest.param(m, lay, b, marks=() if (m, lay, b) in DEFAULT else pytest.mark.slow)
        for b in ("aot_eager", "inductor")
        for m in MODELS
        for lay in LAYOUTS
    ],
)
def test_fused_layers_match_eager(model, layout, backend):
    flags, world = LAYOUTS[layout]
    model_flags, heads, groups = MODELS[model]
    fused = run_layout(
        BASE + model_flags + SHORT + flags + ["--fused-layers", "--fused-layers-backend", backend],
        world,
    )
    loss_diff, param_diff = compare(eager(model, layout), fused, heads, groups)
    print(f"{model} {layout} {backend}: loss diff {loss_diff:.2e}, param diff {param_diff:.2e}")
    assert loss_diff < 1e-5 and param_diff < 1e-5
