"""fp16 with fp32 master weights and Megatron's loss scaling: scale arithmetic, exact unscaling,
skipped overflow steps (logged, nothing updated), and training that tracks fp32."""

import logging
import math

import pytest
import torch

from megatron_ul.config import ConfigError
from megatron_ul.optim.precision import GradScaler
from megatron_ul.training.pretrain import configure, setup
from tests.distributed import run_distributed
from tests.training.equivalence import BASE, GPT2_STYLE, run_layout


def test_dynamic_scale_follows_megatron_hysteresis_and_window():
    s = GradScaler(1024.0, min_scale=128.0, window=3, hysteresis=2)
    seen = []
    for found_inf in [True, True, True, False, False, False, True, True, True, True, True]:
        s.update(found_inf)
        seen.append(s.scale)
    # 1st overflow uses up hysteresis (no change), then halve on each overflow; 3 good steps
    # double and refill hysteresis; then 1 free overflow, then halve down to the floor.
    assert seen == [1024, 512, 256, 256, 256, 512, 512, 256, 128, 128, 128]
    assert s.skipped_steps == 8


def test_constant_scale_never_moves_but_still_skips():
    s = GradScaler(64.0, dynamic=False)
    s.update(True)
    s.update(False)
    assert s.scale == 64.0 and s.skipped_steps == 1


def test_unscale_is_exact_and_detects_overflow():
    p, q = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    p.grad, q.grad = torch.tensor([3.0, -1.5, 1e-3]) * 2**20, torch.tensor([2.0, 1.0]) * 2**20
    s = GradScaler(2.0**20, hysteresis=1)
    assert s.unscale_and_check([p.grad, q.grad], p.device)
    assert p.grad.equal(torch.tensor([3.0, -1.5, 1e-3])) and q.grad.equal(torch.tensor([2.0, 1.0]))
    q.grad[0] = float("inf")
    assert not s.unscale_and_check([p.grad, q.grad], p.device) and s.scale == 2.0**19


def train_fp16_and_watch(rank, world, argv):
    """Train; return losses, the skip warnings, and whether parameters moved on skipped steps."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron_ul").addHandler(handler)
    trainer = setup(configure(argv, world))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    losses = trainer.train()
    moved = any(not a.equal(b) for a, b in zip(before, trainer.model.parameters()))
    skips = [r.getMessage() for r in records if "skipping this step" in r.getMessage()]
    return {"losses": losses, "skips": skips, "moved": moved}


def test_overflowing_steps_are_skipped_and_logged():
    # 2^120 overflows fp16 gradients; halving every step (hysteresis 1) cannot reach a usable
    # scale within 3 iterations, so every step is skipped and nothing may change.
    argv = (
        BASE
        + GPT2_STYLE
        + [
            "--fp16",
            "--initial-loss-scale",
            str(2.0**120),
            "--hysteresis",
            "1",
            "--train-iters",
            "3",
        ]
    )
    out = run_distributed(train_fp16_and_watch, 1, argv)[0]
    assert len(out["skips"]) == 3 and "iteration 1" in out["skips"][0]
    assert not out["moved"]
    assert all(math.isfinite(x) for x in out["losses"])


def test_fp16_tracks_fp32():
    fp32 = run_layout(BASE + GPT2_STYLE, 1)
    fp16 = run_layout(BASE + GPT2_STYLE + ["--fp16", "--initial-loss-scale", "4096"], 1)
    assert max(abs(a - b) for a, b in zip(fp32[0], fp16[0])) < 2e-2
    assert fp32[0] != fp16[0]  # it really computed in half precision
    for name, ref in fp32[1].items():
        assert float((fp16[1][name] - ref).abs().max() / ref.abs().max()) < 5e-2, name


@pytest.mark.slow
def test_fp16_with_zero1_over_sp2_tracks_fp32():
    fp32 = run_layout(BASE + GPT2_STYLE, 1)
    fp16 = run_layout(
        BASE
        + GPT2_STYLE
        + [
            "--fp16",
            "--initial-loss-scale",
            "4096",
            "--ds-sequence-parallel-size",
            "2",
            "--use-distributed-optimizer",
        ],
        2,
    )
    assert max(abs(a - b) for a, b in zip(fp32[0], fp16[0])) < 2e-2


def test_loss_scale_without_fp16_is_refused():
    with pytest.raises(ConfigError, match="--loss-scale only applies to --fp16"):
        configure(BASE + GPT2_STYLE + ["--loss-scale", "1024"], 1)
