"""Tiled attention block (--attention-block-tiles): per-token losses and every gradient equal
the untiled block (fp32 within 1e-6), GPT and Llama (GQA, RoPE, RMSNorm), under full
recompute, TP with and without Megatron-SP, Ulysses; the tiling's row bookkeeping; and the
block keeps neither the norm output nor a re-laid-out attention output for backward."""

import pytest
import torch

from megatron_ul.config import ModelConfig
from megatron_ul.model.attention.block_tiles import merge_tiles, tile_rows
from megatron_ul.model.layer_spec import layer_spec
from megatron_ul.model.transformer import TransformerLayer
from megatron_ul.mpu import parallel_state as ps
from megatron_ul.mpu.random import model_parallel_seed
from tests.distributed import run_distributed
from tests.model.long_context_harness import LLAMA, MODEL, compare_runs
from tools.bench.saved_bytes import saved_activation_bytes

TILED = ["--attention-block-tiles", "4"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
LAYOUTS = {
    "single": ([], (1, 1), 1),
    "TP2": (["--tensor-model-parallel-size", "2"], (2, 1), 2),
    "TP2-megatron-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], (2, 1), 2),
    "SP2": (["--ds-sequence-parallel-size", "2"], (1, 2), 2),
}


VARIANTS = {"gpt": [], "llama-gqa-rope": LLAMA, "llama-full-recompute": LLAMA + FULL_RECOMPUTE}


def _compare(rank, world, layout, variant):
    flags, sizes, _ = LAYOUTS[layout]
    return compare_runs(rank, world, MODEL + flags + VARIANTS[variant], TILED, sizes)


CASES = [(layout, variant) for layout in LAYOUTS for variant in VARIANTS]


@pytest.mark.slow  # the default suite trains with tiles (tests/training/test_tiled_attention_*)
@pytest.mark.parametrize("layout,variant", CASES)
def test_tiled_attention_block_equals_untiled(layout, variant):
    for loss_diff, grad_diff in run_distributed(_compare, LAYOUTS[layout][2], layout, variant):
        assert loss_diff <= 1e-6 and grad_diff <= 1e-6, (layout, variant, loss_diff, grad_diff)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_merge_tiles_puts_gathered_rows_back_in_sequence_order(ranks):
    """Tile k of a Megatron-SP layout holds every rank's k-th piece, rank-major (what the QKV
    all-gather returns); merging all tiles gives back the sequence order."""
    tiles, c = 4, 3
    seq = torch.arange(ranks * tiles * c).view(-1, 1)
    pieces = [tile_rows(seq, tiles, k, ranks) for k in range(tiles)]
    for k, piece in enumerate(pieces):  # the rows the all-gather of each rank's tile k gives
        expected = [r * tiles * c + k * c + i for r in range(ranks) for i in range(c)]
        assert piece.flatten().tolist() == expected
    assert torch.equal(merge_tiles(pieces, ranks), seq)
    assert pieces == []


def _saved_bytes(rank, world):
    dims = ps.initialize_model_parallel(1, 1, 1)
    model_parallel_seed(0, dims)
    saved = {}
    for tiles in (1, 4):
        cfg = ModelConfig(
            hidden_size=64,
            num_attention_heads=4,
            attention_dropout=0.0,  # the fused kernel, which saves its output itself
            hidden_dropout=0.0,
            attention_block_tiles=tiles,
        )
        layer = TransformerLayer(cfg, 0, 0, False, dims=dims, spec=layer_spec(cfg))
        x = torch.randn(S, 1, 64, requires_grad=True)
        _, saved[tiles] = saved_activation_bytes(
            lambda layer=layer, x=x: layer(x), exclude=list(layer.parameters()) + [x]
        )
    return saved


S = 256


@pytest.mark.slow
def test_tiled_block_keeps_no_norm_output_and_no_relaid_attention_output():
    """Untiled, the QKV projection keeps the input norm's output and the output projection a
    re-laid-out copy of the attention output; tiled, each tile keeps only views of the layer
    input and of the attention output, so both [s, b, h] tensors are gone."""
    saved = run_distributed(_saved_bytes, 1)[0]
    unit = S * 64 * 4
    assert saved[1] - saved[4] >= 2 * unit, saved
