"""--activation-checkpoint-cpu-offload changes where the full-recompute layer inputs wait, not
results: with dropout ON, per-step losses and final parameters are bit-identical to plain full
recompute; every offloaded input is fetched once, after the next one prefetched it."""

import pytest

from megatron_ul.config import ConfigError
from megatron_ul.training.pretrain import configure
from tests.distributed import run_distributed
from tests.model.long_context_harness import slow_except
from tests.optim.test_recompute import DROPOUT_ON, assert_identical
from tests.training.equivalence import run_layout

FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
OFFLOAD = ["--activation-checkpoint-cpu-offload"]
LAYOUTS = {
    "single": ([], 1),
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
    "PP2-tiled": (
        ["--pipeline-model-parallel-size", "2", "--tiled-mlp-chunk-size", "8", "--num-layers", "4"],
        2,
    ),
}


@pytest.mark.parametrize("layout", slow_except({"single"}, LAYOUTS))
@pytest.mark.parametrize("per_checkpoint", ["1", pytest.param("2", marks=pytest.mark.slow)])
def test_offload_is_bit_identical(layout, per_checkpoint):
    flags, world = LAYOUTS[layout]
    argv = DROPOUT_ON + FULL + ["--recompute-num-layers", per_checkpoint] + flags
    assert_identical(run_layout(argv, world), run_layout(argv + OFFLOAD, world))


def _handle_counts(rank, world, argv):
    from megatron_ul.training.pretrain import setup

    trainer = setup(configure(argv, world))
    trainer.train()
    return trainer.model.offloader.counts


def test_every_offloaded_input_is_prefetched_then_fetched():
    argv = DROPOUT_ON + FULL + OFFLOAD  # 3 layers, one checkpoint each; 5 steps × 4 micro
    counts = run_distributed(_handle_counts, 1, argv)[0]
    assert counts["offloaded"] == counts["prefetched"] == counts["fetched"] == 5 * 4 * 3


def test_offload_needs_full_recompute():
    with pytest.raises(ConfigError, match="--activation-checkpoint-cpu-offload"):
        configure(DROPOUT_ON + OFFLOAD, 1)


@pytest.mark.slow
def test_offload_is_bit_identical_under_zero3():
    from tests.training.equivalence import run_zero_layout

    argv = DROPOUT_ON + FULL + ["--ds-sequence-parallel-size", "2", "--zero-stage", "3"]
    assert_identical(run_zero_layout(argv, 2)[:2], run_zero_layout(argv + OFFLOAD, 2)[:2])
