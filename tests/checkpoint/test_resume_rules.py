"""Every setting of resume_rules.SETTINGS, changed on resume, is refused naming the flag and
the checkpoint's value, or applied with one log line saying this run's value wins — and the
value the run then uses is the one said. One row per setting; every row of the table is
covered (a new setting without a row fails)."""

import logging

import pytest

from megatron_ul.checkpoint import files
from megatron_ul.checkpoint.storage.dcp_pieces import torch_optimizer
from megatron_ul.checkpoint.training import resume_rules
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.conftest import copy_of
from tests.checkpoint.runs import TINY_TWO_ITERS as ARGV

OVERRIDE, USE_CKPT = "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"


def _group(i, key):
    return lambda t: torch_optimizer(t.optimizer).param_groups[i][key]


def _schedule(key):
    return lambda t: t.scheduler.state_dict()[key]


def _cfg(section, key):
    return lambda t: getattr(getattr(t.cfg, section), key)


# flag: (changed flags, the checkpoint's value, this run's value, what the run uses)
ROWS = {
    "--lr": (["--lr", "2e-3"], 1e-3, 2e-3, _schedule("max_lr")),
    "--min-lr": (["--min-lr", "2e-4"], 1e-4, 2e-4, _schedule("min_lr")),
    "--lr-warmup-iters": (["--lr-warmup-iters", "0"], 1, 0, _schedule("warmup_steps")),
    "--lr-decay-iters (default --train-iters)": (
        ["--lr-decay-iters", "3"],
        2,
        3,
        _schedule("decay_steps"),
    ),
    "--lr-decay-style": (
        ["--lr-decay-style", "linear"],
        "cosine",
        "linear",
        _schedule("decay_style"),
    ),
    "--weight-decay": (["--weight-decay", "0.1"], 0.01, 0.1, _group(0, "weight_decay")),
    "--adam-beta1": (["--adam-beta1", "0.8"], 0.9, 0.8, lambda t: _group(0, "betas")(t)[0]),
    "--adam-beta2": (["--adam-beta2", "0.95"], 0.999, 0.95, lambda t: _group(1, "betas")(t)[1]),
    "--adam-eps": (["--adam-eps", "1e-5"], 1e-6, 1e-5, _group(0, "eps")),
    "--clip-grad": (["--clip-grad", "0.5"], 1.0, 0.5, _cfg("train", "clip_grad")),
    "--train-iters": (
        ["--train-iters", "4", "--lr-decay-iters", "2"],
        2,
        4,
        _cfg("train", "train_iters"),
    ),
    "--seed": (["--seed", "8"], 7, 8, _cfg("train", "seed")),
    "--global-batch-size": (
        ["--global-batch-size", "16"],
        8,
        16,
        _cfg("train", "global_batch_size"),
    ),
    "--micro-batch-size": (["--micro-batch-size", "1"], 2, 1, _cfg("train", "micro_batch_size")),
    "--seq-length": (
        ["--seq-length", "8", "--max-position-embeddings", "16"],
        16,
        8,
        _cfg("model", "seq_length"),
    ),
}
RULES = {s.flag: s.rule for s in resume_rules.SETTINGS}


def test_every_setting_has_a_row():
    """The rest of the table: tests/checkpoint/test_resume_every_setting.py (which checks
    that the two files together cover every row)."""
    assert set(ROWS) <= set(RULES)


def _resume(save, flags, caplog):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_ul"):
        trainer = setup(configure(ARGV + ["--load", save] + flags, 1))
    return trainer, [r.getMessage() for r in caplog.records if "resume: " in r.getMessage()]


QUICK = {"--lr", "--weight-decay", "--adam-beta2", "--seed"}  # the rest: --run-slow


@pytest.mark.parametrize(
    "flag", [pytest.param(f, marks=() if f in QUICK else pytest.mark.slow) for f in sorted(ROWS)]
)
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_changed_setting_is_refused_or_said(flag, fmt, pristine, tmp_path, single_rank, caplog):
    if fmt == "torch_dist" and flag not in ("--weight-decay", "--adam-beta2"):
        pytest.skip("the formats differ only in how the optimizer's groups are restored")
    save = copy_of(pristine, fmt, tmp_path / "ckpt")
    changed, theirs, ours, used = ROWS[flag]
    changed = changed + ["--ckpt-format", fmt]  # the checkpoint's: not a change
    if RULES[flag] == resume_rules.RUN:
        trainer, said = _resume(save, changed, caplog)
        assert said == [
            f"resume: {flag}: this run's {ours!r} wins over the checkpoint's "
            f"{theirs!r}: {_effect(flag)}"
        ]
        assert used(trainer) == ours
        return
    with pytest.raises(files.CheckpointError) as info:
        setup(configure(ARGV + ["--load", save] + changed, 1))
    assert f"{flag}: checkpoint {theirs!r}, this run {ours!r}" in str(info.value)
    trainer, said = _resume(save, changed + [OVERRIDE], caplog)
    assert said == [
        f"resume: {flag}: this run's {ours!r} wins over the checkpoint's "
        f"{theirs!r} ({OVERRIDE}): {_effect(flag)}"
    ]
    assert used(trainer) == ours
    trainer, said = _resume(save, changed + [USE_CKPT], caplog)
    assert said == [
        f"resume: {flag}: the checkpoint's {theirs!r} wins over this run's {ours!r} ({USE_CKPT})"
    ]
    assert used(trainer) == theirs


def _effect(flag):
    return next(s.effect for s in resume_rules.SETTINGS if s.flag == flag)


def test_an_unchanged_resume_says_nothing(pristine, tmp_path, single_rank, caplog):
    _, said = _resume(copy_of(pristine, "torch", tmp_path / "ckpt"), [], caplog)
    assert said == []
