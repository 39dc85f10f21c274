"""Every config field has a resume rule: refused (load.MODEL_FIELDS and the learned-position and
RoPE checks), a row of resume_rules.SETTINGS (refused or said), or NEUTRAL with why it needs
none. A new field in none of them fails here. The rows added for settings that change the
losses (dropout, precision, the window, the data) are each said with this run's value, and a
resume that does not load the optimizer says them too."""

import dataclasses
import logging
import typing

import numpy as np
import pytest

from megatron_ul.checkpoint.training import load, resume_rules
from megatron_ul.config import ResolvedConfig, ResolvedModelConfig
from megatron_ul.data.indexed_dataset import IndexedDatasetBuilder
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.conftest import copy_of
from tests.checkpoint.runs import TINY_TWO_ITERS as ARGV

REFUSED = {f"model.{f}" for f in {**load.MODEL_FIELDS, **load.ROPE_FIELDS}}


def _config_fields(config_cls) -> set[str]:
    out = set()
    hints = typing.get_type_hints(config_cls)
    for section in dataclasses.fields(config_cls):
        for f in dataclasses.fields(hints[section.name]):
            out.add(f"{section.name}.{f.name}")
    return out


def _without_rule(config_cls) -> set[str]:
    ruled = {resume_rules.SCHEDULER_FIELDS.get(s.saved, s.saved) for s in resume_rules.SETTINGS}
    return _config_fields(config_cls) - ruled - REFUSED - set(resume_rules.NEUTRAL)


def test_every_config_field_has_a_resume_rule():
    missing = _without_rule(ResolvedConfig)
    assert not missing, f"config fields with no resume rule: {sorted(missing)}"
    # no rule names a field that no longer exists, and no field has two
    ruled = {resume_rules.SCHEDULER_FIELDS.get(s.saved, s.saved) for s in resume_rules.SETTINGS}
    assert not (ruled | REFUSED | set(resume_rules.NEUTRAL)) - _config_fields(ResolvedConfig)
    assert not ruled & set(resume_rules.NEUTRAL) and not REFUSED & set(resume_rules.NEUTRAL)
    assert not ruled & REFUSED


def test_a_new_field_without_a_rule_is_found():
    @dataclasses.dataclass
    class GrownModel(ResolvedModelConfig):
        brand_new_knob: float = 0.5

    @dataclasses.dataclass
    class Grown(ResolvedConfig):
        model: GrownModel = dataclasses.field(default_factory=GrownModel)

    assert _without_rule(Grown) == {"model.brand_new_knob"}


def _dataset(prefix: str) -> str:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(64):
        builder.add_document(rng.integers(0, 199, 40), [40])
    builder.finalize(prefix + ".idx")
    return prefix


# flag: (changed flags, the checkpoint's value, this run's value) for the rows below
def _rows(tmp_path) -> dict:
    data = _dataset(str(tmp_path / "corpus"))
    return {
        "--hidden-dropout": (["--hidden-dropout", "0.2"], 0.1, 0.2),
        "--attention-dropout": (["--attention-dropout", "0.0"], 0.1, 0.0),
        "--window-size": (["--window-size", "4", "0"], None, [4, 0]),
        "--make-vocab-size-divisible-by": (["--make-vocab-size-divisible-by", "52"], 16, 52),
        "--bf16": (["--bf16"], False, True),
        "--fp16": (["--fp16"], False, True),
        "--fp32-residual-connection": (["--bf16", "--fp32-residual-connection"], False, True),
        "--loss-scale": (["--fp16", "--loss-scale", "1024"], None, 1024.0),
        "--initial-loss-scale": (["--initial-loss-scale", "1024"], 2.0**32, 1024.0),
        "--min-loss-scale": (["--min-loss-scale", "2"], 1.0, 2.0),
        "--loss-scale-window": (["--loss-scale-window", "10"], 1000, 10),
        "--hysteresis": (["--hysteresis", "3"], 2, 3),
        "--reset-position-ids": (["--reset-position-ids"], False, True),
        "--reset-attention-mask": (["--reset-attention-mask"], False, True),
        "--eod-mask-loss": (["--eod-mask-loss"], False, True),
        "--mock-data": (
            ["--data-path", data, "--no-mock-data", "--tokenizer-type", "NullTokenizer"],
            True,
            False,
        ),
        "--data-path": (
            ["--data-path", data, "--no-mock-data", "--tokenizer-type", "NullTokenizer"],
            [],
            [data],
        ),
        "--split": (["--split", "90,10,0"], "969,30,1", "90,10,0"),
        "--tokenizer-type": (["--tokenizer-type", "NullTokenizer"], None, "NullTokenizer"),
        "--vocab-file": (["--vocab-file", "v.json"], None, "v.json"),
        "--merge-file": (["--merge-file", "m.txt"], None, "m.txt"),
        "--tokenizer-model": (["--tokenizer-model", "t.model"], None, "t.model"),
        "--ckpt-format": (["--ckpt-format", "torch_dist"], "torch", "torch_dist"),
        **_sparse_rows(),
        **_moe_rows(),
    }


_SPARSE = ["--sparse-block-size", "4", "--attention-dropout", "0"]


def _sparse_rows() -> dict:
    fixed = _SPARSE + ["--sparse-attention", "fixed"]
    bigbird = ["--sparse-attention", "bigbird"]
    variable = _SPARSE + ["--sparse-attention", "variable"]
    return {
        "--sparse-attention": (fixed, None, "fixed"),
        "--sparse-block-size": (_SPARSE, 16, 4),
        "--sparse-attention-direction": (
            fixed + ["--sparse-attention-direction", "bidirectional"],
            "unidirectional",
            "bidirectional",
        ),
        "--sparse-different-layout-per-head": (
            fixed + ["--sparse-different-layout-per-head"],
            False,
            True,
        ),
        "--sparse-num-local-blocks": (fixed + ["--sparse-num-local-blocks", "2"], None, 2),
        "--sparse-num-global-blocks": (fixed + ["--sparse-num-global-blocks", "1"], None, 1),
        "--sparse-horizontal-global-attention": (
            fixed
            + ["--sparse-attention-direction", "bidirectional"]
            + ["--sparse-horizontal-global-attention"],
            False,
            True,
        ),
        "--sparse-num-different-global-patterns": (
            fixed
            + ["--sparse-different-layout-per-head", "--sparse-num-local-blocks", "2"]
            + ["--sparse-num-different-global-patterns", "2"],
            None,
            2,
        ),
        "--sparse-num-random-blocks": (
            _SPARSE + bigbird + ["--sparse-num-random-blocks", "0"],
            None,
            0,
        ),
        "--sparse-num-sliding-window-blocks": (
            _SPARSE + bigbird + ["--sparse-num-sliding-window-blocks", "1"],
            None,
            1,
        ),
        "--sparse-local-window-blocks": (
            variable + ["--sparse-local-window-blocks", "2"],
            None,
            [2],
        ),
        "--sparse-global-block-indices": (
            variable + ["--sparse-global-block-indices", "1"],
            None,
            [1],
        ),
        "--sparse-global-block-end-indices": (
            variable
            + ["--sparse-global-block-indices", "0", "--sparse-global-block-end-indices", "1"],
            None,
            [1],
        ),
    }


_MOE = ["--num-experts", "4", "--disable-bias-linear"]


def _moe_rows() -> dict:
    return {
        "--moe-expert-capacity-factor": (
            _MOE + ["--moe-expert-capacity-factor", "1.5"],
            None,
            1.5,
        ),
        "--moe-token-drop-policy": (
            _MOE + ["--moe-expert-capacity-factor", "1", "--moe-token-drop-policy", "position"],
            "probs",
            "position",
        ),
        "--moe-pad-expert-input-to-capacity": (
            _MOE + ["--moe-expert-capacity-factor", "1", "--moe-pad-expert-input-to-capacity"],
            False,
            True,
        ),
        "--moe-router-load-balancing-type": (
            _MOE + ["--moe-router-load-balancing-type", "none"],
            "aux_loss",
            "none",
        ),
        "--moe-aux-loss-coeff": (_MOE + ["--moe-aux-loss-coeff", "0.01"], 0.0, 0.01),
        "--moe-z-loss-coeff": (_MOE + ["--moe-z-loss-coeff", "0.001"], None, 0.001),
    }


NEW_ROWS = [
    "--hidden-dropout",
    "--attention-dropout",
    "--window-size",
    "--make-vocab-size-divisible-by",
    "--bf16",
    "--fp16",
    "--fp32-residual-connection",
    "--loss-scale",
    "--initial-loss-scale",
    "--min-loss-scale",
    "--loss-scale-window",
    "--hysteresis",
    "--reset-position-ids",
    "--reset-attention-mask",
    "--eod-mask-loss",
    "--mock-data",
    "--data-path",
    "--split",
    "--tokenizer-type",
    "--vocab-file",
    "--merge-file",
    "--tokenizer-model",
    "--ckpt-format",
    *_sparse_rows(),
    *_moe_rows(),
]
_BY_FLAG = {s.flag: s for s in resume_rules.SETTINGS}


def test_every_added_row_is_here():
    """The rows of SETTINGS are covered: test_resume_rules.py's ROWS and NEW_ROWS together."""
    from tests.checkpoint.test_resume_rules import ROWS

    assert set(ROWS) | set(NEW_ROWS) == set(_BY_FLAG)


def _configure(argv):
    """configure(), with --no-mock-data meaning: drop the base's --mock-data."""
    if "--no-mock-data" in argv:
        argv = [a for a in argv if a not in ("--mock-data", "--no-mock-data")]
    return configure(argv, 1)


@pytest.mark.parametrize("flag", NEW_ROWS)
def test_a_changed_setting_is_said_with_this_runs_value(flag, tmp_path, caplog):
    """The comparison a resume makes (the checkpoint's saved arguments against this run's):
    one line per changed setting, naming the flag, both values and the effect; the run keeps
    its own value."""
    changed, theirs, ours = _rows(tmp_path)[flag]
    saved = dataclasses.asdict(_configure(list(ARGV)))
    cfg = _configure(ARGV + changed)
    mine = dataclasses.asdict(cfg)
    diffs = resume_rules.differences(saved, {}, mine, {}, optimizer_loaded=True)
    assert any(s.flag == flag and (a, b) == (theirs, ours) for s, a, b in diffs), diffs
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_ul"):
        resume_rules.apply_rules(diffs, False, False, "ckpt")
    line = (
        f"resume: {flag}: this run's {ours!r} wins over the checkpoint's {theirs!r}: "
        f"{_BY_FLAG[flag].effect}"
    )
    assert line in [r.getMessage() for r in caplog.records]
    section, key = _BY_FLAG[flag].saved.split(".")
    assert mine[section][key] == ours


def _resume(save: str, flags: list, caplog) -> tuple:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_ul"):
        trainer = setup(configure(ARGV + ["--load", save] + flags, 1))
    return trainer, [r.getMessage() for r in caplog.records if "resume: " in r.getMessage()]


@pytest.mark.parametrize(
    "flag,changed,value",
    [
        ("--hidden-dropout", ["--hidden-dropout", "0.2"], 0.2),
        ("--attention-dropout", ["--attention-dropout", "0"], 0.0),
        ("--bf16", ["--bf16"], True),
        ("--ckpt-format", ["--ckpt-format", "torch_dist"], "torch_dist"),
    ],
)
def test_a_resume_says_the_change(flag, changed, value, pristine, tmp_path, single_rank, caplog):
    """End to end: the resume says the change once and runs with this run's value, with and
    without loading the optimizer."""
    save = copy_of(pristine, "torch", tmp_path / "ckpt")
    section, key = _BY_FLAG[flag].saved.split(".")
    for extra in ([], ["--no-load-optim"]):
        trainer, said = _resume(save, changed + extra, caplog)
        assert [s for s in said if f" {flag}:" in s] == [
            f"resume: {flag}: this run's {value!r} wins over the checkpoint's "
            f"{getattr(getattr(configure(ARGV, 1), section), key)!r}: {_BY_FLAG[flag].effect}"
        ], said
        assert getattr(getattr(trainer.cfg, section), key) == value
