"""The learning-rate schedule against Megatron's: points whose values follow from the shape of
each curve alone, and, where megatron-core is installed, Megatron's own OptimizerParamScheduler
stepped the way Megatron-LM's training loop steps it (in samples, one global batch a step)."""

import math

import pytest
import torch

from megatron_ul.optim.lr_schedule import LRSchedule

MAX_LR, MIN_LR, WARMUP, DECAY = 3e-4, 3e-5, 10, 110


def schedule(style, warmup=WARMUP, decay=DECAY):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return LRSchedule(
        optimizer,
        max_lr=MAX_LR,
        min_lr=MIN_LR,
        warmup_steps=warmup,
        decay_steps=decay,
        decay_style=style,
    )


def lrs(sched, steps):
    """The lr the optimizer holds before each step 0..steps-1 (what each iteration trains with)."""
    out = []
    for _ in range(steps):
        out.append(sched.optimizer.param_groups[0]["lr"])
        sched.step()
    return out


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_warmup_rises_linearly_from_zero_to_the_peak(style):
    seen = lrs(schedule(style), WARMUP + 1)
    assert seen[0] == 0.0
    assert seen[WARMUP] == pytest.approx(MAX_LR, rel=1e-15)
    rises = [b - a for a, b in zip(seen, seen[1:])]
    assert all(r == pytest.approx(MAX_LR / WARMUP, rel=1e-9) for r in rises)


def test_constant_holds_the_peak_after_warmup_and_past_the_decay_horizon():
    assert set(lrs(schedule("constant"), DECAY + 20)[WARMUP:]) == {MAX_LR}


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_decay_reaches_min_lr_at_the_horizon_and_stays_there(style):
    seen = lrs(schedule(style), DECAY + 20)
    assert seen[DECAY] == pytest.approx(MIN_LR, rel=1e-12)
    assert set(seen[DECAY + 1 :]) == {MIN_LR}
    decaying = seen[WARMUP : DECAY + 1]
    assert all(a > b for a, b in zip(decaying, decaying[1:])), "monotone decay"


def test_linear_and_cosine_at_the_quarter_points_of_the_decay():
    span = DECAY - WARMUP
    quarter, half = WARMUP + span // 4, WARMUP + span // 2
    linear, cosine = lrs(schedule("linear"), DECAY), lrs(schedule("cosine"), DECAY)
    assert linear[quarter] == pytest.approx(MIN_LR + 0.75 * (MAX_LR - MIN_LR), rel=1e-12)
    assert linear[half] == pytest.approx((MAX_LR + MIN_LR) / 2, rel=1e-12)
    assert cosine[half] == pytest.approx((MAX_LR + MIN_LR) / 2, rel=1e-12)
    # cos(pi/4) = sqrt(2)/2: the cosine stays above the line in the first half
    expected = MIN_LR + (1 + math.sqrt(0.5)) / 2 * (MAX_LR - MIN_LR)
    assert cosine[quarter] == pytest.approx(expected, rel=1e-12)
    assert cosine[quarter] > linear[quarter]


def test_no_warmup_starts_at_the_peak():
    assert lrs(schedule("cosine", warmup=0), 1) == [MAX_LR]


def test_a_restored_schedule_continues_the_same_curve():
    whole = lrs(schedule("cosine"), DECAY + 5)
    first = schedule("cosine")
    lrs(first, 37)
    resumed = schedule("cosine")
    resumed.load_state_dict(first.state_dict())
    assert lrs(resumed, DECAY + 5 - 37) == whole[37:]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, WARMUP])
def test_matches_megatron_cores_scheduler_stepped_in_samples(style, warmup):
    scheduler_module = pytest.importorskip("megatron.core.optimizer_param_scheduler")
    global_batch = 48
    group = {"lr": 1.0, "weight_decay": 0.0}
    optimizer = type("Optimizer", (), {"param_groups": [group]})()
    reference = scheduler_module.OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=MAX_LR,
        min_lr=MIN_LR,
        lr_warmup_steps=warmup * global_batch,
        lr_decay_steps=DECAY * global_batch,
        lr_decay_style=style,
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=DECAY * global_batch,
        wd_incr_style="constant",
    )
    theirs = []
    for _ in range(DECAY + 10):
        theirs.append(group["lr"])
        reference.step(increment=global_batch)
    ours = lrs(schedule(style, warmup=warmup), DECAY + 10)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=0.0)
