"""Tiled attention block (--attention-block-tiles): per-token losses and every gradient equal
the untiled block (fp32 within 1e-6), GPT and Llama (GQA, RoPE, RMSNorm), under full
recompute, TP with and without Megatron-SP, Ulysses; the tiling's row bookkeeping; and the
block keeps neither the norm output nor a re-laid-out attention output for backward."""

import pytest
import torch

from megatron_ul.model.tiled_attention import merge_tiles, tile_rows
from tests.distributed import run_distributed
from tests.model.long_context_harness import LLAMA, MODEL, compare_runs

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


@pytest.mark.parametrize(
    "layout,variant",
    [
        pytest.param(
            *case,
            marks=() if case == ("TP2-megatron-sp", "llama-full-recompute") else pytest.mark.slow,
        )
        for case in CASES
    ],
)
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
