"""Tiled MLP: per-token losses and every gradient equal the untiled MLP (fp32 within 1e-6),
GELU and SwiGLU, TP with and without Megatron-SP, Ulysses, under full recompute too; and only
one chunk's intermediate is alive at a time."""

import pytest
import torch

from megatron_ul.config import ModelConfig
from megatron_ul.model.layer_spec import layer_spec
from megatron_ul.mpu import parallel_state as ps
from tests.distributed import run_distributed
from tests.model.long_context_harness import LLAMA, MODEL, compare_runs, slow_except
from tools.bench.saved_bytes import saved_activation_bytes

TILED = ["--tiled-mlp-chunk-size", "5"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
LAYOUTS = {
    "single": ([], (1, 1), 1),
    "TP2-megatron-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], (2, 1), 2),
    "SP2": (["--ds-sequence-parallel-size", "2"], (1, 2), 2),
}


def _cases(rank, world, layout):
    flags, sizes, _ = LAYOUTS[layout]
    return {
        name: compare_runs(rank, world, MODEL + flags + extra, TILED, sizes)
        for name, extra in {
            "gelu": [],
            "swiglu-gqa": LLAMA,
            "full-recompute": FULL_RECOMPUTE,
        }.items()
    }


@pytest.mark.parametrize("layout", slow_except({"single"}, LAYOUTS))
def test_tiled_mlp_equals_untiled(layout):
    for rank_result in run_distributed(_cases, LAYOUTS[layout][2], layout):
        for name, (loss_diff, grad_diff) in rank_result.items():
            assert loss_diff <= 1e-6 and grad_diff <= 1e-6, (layout, name, loss_diff, grad_diff)


FFN = 64  # explicit: SwiGLU's default width (Megatron's rounding down to 64) is 0 at hidden 16


def _saved_bytes(rank, world):
    dims = ps.initialize_model_parallel(1, 1, 1)
    saved = {}
    for swiglu in (False, True):
        for chunk in (None, 32):
            cfg = ModelConfig(
                hidden_size=16,
                num_attention_heads=2,
                swiglu=swiglu,
                ffn_hidden_size=FFN,
                tiled_mlp_chunk_size=chunk,
            )
            mlp = layer_spec(cfg).mlp(cfg, "mlp", 0, False, 1, None, torch.float32, dims=dims)
            x = torch.randn(256, 1, 16, requires_grad=True)
            _, saved[swiglu, chunk] = saved_activation_bytes(
                lambda mlp=mlp, x=x: mlp(x), exclude=list(mlp.parameters()) + [x]
            )
    return saved


def test_tiled_mlp_keeps_no_intermediate():
    """Untiled, the MLP keeps its [s, b, ffn] intermediates for backward; tiled, it keeps only
    its chunk inputs (views of x), i.e. nothing new."""
    saved = run_distributed(_saved_bytes, 1)[0]
    for swiglu in (False, True):
        ffn_bytes = 256 * FFN * 4
        assert saved[swiglu, None] >= 2 * ffn_bytes
        assert saved[swiglu, 32] < ffn_bytes / 8
