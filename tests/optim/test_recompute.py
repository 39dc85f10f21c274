"""Activation recomputation changes memory, not results: with dropout ON, every recompute
mode gives bit-identical per-step losses and final parameters to the run without it, because
the recomputed forward replays both the default generator and the RNG tracker's streams."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from megatron_ul.config import ConfigError
from megatron_ul.mpu.random import MODEL_PARALLEL_RNG, get_rng_tracker
from megatron_ul.mpu.recompute import checkpoint
from megatron_ul.training.pretrain import configure
from tests.training.equivalence import BASE, GPT2_STYLE, run_layout

DROPOUT_ON = (
    BASE
    + GPT2_STYLE
    + ["--attention-dropout", "0.2", "--hidden-dropout", "0.2", "--num-layers", "3"]
)
MODES = {
    "full-uniform-2": [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "2",
    ],
    "full-block-2": [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        "2",
    ],
    "selective": ["--recompute-granularity", "selective"],
}
LAYOUTS = {
    "single": ([], 1),
    # Megatron-SP puts hidden dropout on the tracker's per-rank stream as well.
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


@functools.cache
def without_recompute(layout: str):
    flags, world = LAYOUTS[layout]
    return run_layout(DROPOUT_ON + flags, world)


def assert_identical(reference, candidate):
    ref_losses, ref_params = reference
    losses, params = candidate
    assert losses == ref_losses
    for name, ref in ref_params.items():
        assert params[name].equal(ref), name


DEFAULT: set = set()  # the default suite: the checkpoint unit test below; layouts: --run-slow


@pytest.mark.parametrize(
    "layout,mode",
    [
        pytest.param(layout, mode, marks=() if (layout, mode) in DEFAULT else pytest.mark.slow)
        for layout in LAYOUTS
        for mode in MODES
    ],
)
def test_recompute_is_bit_identical_with_dropout(layout, mode):
    flags, world = LAYOUTS[layout]
    assert_identical(without_recompute(layout), run_layout(DROPOUT_ON + flags + MODES[mode], world))


def _dropout_twice(x):
    """Dropout on both streams: the default generator and the tracker's."""
    with get_rng_tracker().fork():
        y = F.dropout(x, 0.5, True)
    return F.dropout(y * 3.0, 0.5, True)


def _grad(run) -> torch.Tensor:
    get_rng_tracker().reset()
    get_rng_tracker().add(MODEL_PARALLEL_RNG, 11)
    torch.manual_seed(5)
    x = torch.ones(64, requires_grad=True)
    out = run(x)
    _dropout_twice(torch.ones(64))  # later work advances both streams before backward
    out.sum().backward()
    return x.grad


def test_checkpoint_replays_tracker_and_default_streams():
    direct = _grad(_dropout_twice)
    assert direct.count_nonzero() not in (0, 64)  # dropout really dropped something
    assert _grad(lambda x: checkpoint(_dropout_twice, x)).equal(direct)
    # torch's checkpoint alone restores only the default generator: the tracker's mask differs
    plain = _grad(lambda x: torch_checkpoint(_dropout_twice, x, use_reentrant=False))
    assert not plain.equal(direct)


@pytest.mark.parametrize(
    "flags",
    [
        ["--recompute-granularity", "full"],
        ["--recompute-granularity", "selective", "--recompute-method", "block"],
        ["--recompute-method", "uniform"],
    ],
)
def test_bad_recompute_flags_are_refused(flags):
    with pytest.raises(ConfigError, match="--recompute-"):
        configure(BASE + GPT2_STYLE + flags, 1)
