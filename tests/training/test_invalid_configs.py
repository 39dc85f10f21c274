"""Every invalid configuration is refused by pretrain's entry point before any model is built:
all problems in one report, each naming its flag, exit status 2, no traceback; the edge values
Megatron-LM gives a meaning to are accepted and behave as there."""

import dataclasses
import os
import subprocess
import sys
import typing

import pytest

from megatron_ul.config import Config
from megatron_ul.config_rules import JUDGED_BY_RULES, RANGES
from megatron_ul.training import pretrain
from tests.refusals import refusal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OK = [
    "--mock-data",
    "--vocab-size",
    "100",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--train-iters",
    "10",
]

# (flags added to OK, text the report must hold)
REFUSED = [
    (["--lr-decay-iters", "0"], "--lr-decay-iters must be >= 1 (got 0)"),
    (["--min-lr", "0.01", "--lr", "0.001"], "--min-lr 0.01 is above --lr 0.001"),
    (["--lr-warmup-iters", "20"], "--lr-warmup-iters 20 must be below --lr-decay-iters 10"),
    (["--lr-warmup-iters", "5", "--lr-decay-iters", "5"], "--lr-warmup-iters 5 must be below"),
    (["--kv-channels", "0"], "--kv-channels must be >= 1 (got 0)"),
    (["--clip-grad", "-1"], "--clip-grad must be >= 0 (got -1.0)"),
    (["--init-method-std", "-1"], "--init-method-std must be > 0 (got -1.0)"),
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1 (got 0)"),
    (["--global-batch-size", "-4"], "--global-batch-size must be >= 1 (got -4)"),
    (["--lr", "-1"], "--lr must be >= 0 (got -1.0)"),
    (["--adam-beta1", "1.5"], "--adam-beta1 must be in [0, 1) (got 1.5)"),
    (["--adam-beta2", "1"], "--adam-beta2 must be in [0, 1) (got 1.0)"),
    (["--adam-eps=-1e-8"], "--adam-eps must be >= 0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
    (["--attention-dropout", "1"], "--attention-dropout must be in [0, 1) (got 1.0)"),
    (["--hidden-dropout", "-0.1"], "--hidden-dropout must be in [0, 1) (got -0.1)"),
    (["--seed", "-1"], "--seed must be in [0, 4294967295] (got -1)"),
    (["--seed", str(2**32)], "--seed must be in [0, 4294967295]"),
    (["--log-interval", "0"], "--log-interval must be >= 1 (got 0)"),
    (["--eval-iters", "-1"], "--eval-iters must be >= 0 (got -1)"),
    (["--eval-interval", "-1"], "--eval-interval must be >= 0 (got -1)"),
    (["--split", "abc"], "--split 'abc'"),
    (["--split", "0,0,0"], "--split '0,0,0'"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by must be >= 1"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be > 0"),
    (["--train-iters", "0"], "--train-iters must be >= 1 (got 0)"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1 (got 0)"),
    (["--num-layers", "0"], "--num-layers must be >= 1 (got 0)"),
    (["--hidden-size", "-8"], "--hidden-size must be >= 1 (got -8)"),
    (["--seq-length", "0"], "--seq-length must be >= 1 (got 0)"),
    (["--max-position-embeddings", "0"], "--max-position-embeddings must be >= 1 (got 0)"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be >= 1 (got 0)"),
    (["--group-query-attention", "--num-query-groups", "0"], "--num-query-groups must be >= 1"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1"),
    (["--context-parallel-size", "-1"], "--context-parallel-size must be >= 1"),
    (["--rotary-base", "0"], "--rotary-base must be > 0"),
    (["--norm-epsilon", "0"], "--norm-epsilon must be > 0"),
    (["--recompute-num-layers", "0"], "--recompute-num-layers must be >= 1"),
    (["--tiled-mlp-chunk-size", "0"], "--tiled-mlp-chunk-size must be >= 1"),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size must be >= 1"),
    (["--loss-scale-window", "0"], "--loss-scale-window must be >= 1"),
    (["--hysteresis", "0"], "--hysteresis must be >= 1"),
    (["--initial-loss-scale", "0"], "--initial-loss-scale must be > 0"),
    (["--exit-interval", "0"], "--exit-interval must be >= 1"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be > 0"),
    (["--keep-last-n-checkpoints", "0"], "--keep-last-n-checkpoints must be >= 1"),
    (["--peak-tflops", "0"], "--peak-tflops must be > 0"),
    (["--lr", "nan"], "--lr must be >= 0 (got nan)"),
    (["--lr", "inf"], "--lr must be >= 0 (got inf)"),
    (["--vocab-size", "-1"], "--vocab-size must be >= 0 (got -1)"),
    (["--vocab-size", "1"], "--mock-data needs --vocab-size N (N >= 2"),
    (["--zero-stage", "4"], "--zero-stage 4 is not available"),
    (["--window-size", "4", "1"], "RIGHT must be 0"),
]


@pytest.mark.parametrize("flags,message", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_refused_before_the_model_naming_the_flag(flags, message, capsys, monkeypatch):
    err = refusal(OK + flags, capsys, monkeypatch)
    assert message in err, err


def test_path_flags_are_checked(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "a_file"
    afile.write_text("")
    err = refusal(
        OK
        + [
            "--tensorboard-dir",
            str(afile),
            "--save",
            str(afile),
            "--data-cache-path",
            str(afile),
            "--load",
            str(tmp_path / "none"),
        ],
        capsys,
        monkeypatch,
    )
    for flag in ("--tensorboard-dir", "--save", "--data-cache-path"):
        assert f"{flag} {afile} exists and is not a directory" in err
    assert f"--load {tmp_path / 'none'}: no such directory" in err


def test_no_data_flag_names_the_data_flags(capsys, monkeypatch):
    err = refusal(["--num-layers", "2"], capsys, monkeypatch)
    assert "no training data: pass --data-path PREFIX" in err and "--mock-data" in err
    assert "--vocab-size" not in err


def test_every_problem_in_one_report(tmp_path, capsys, monkeypatch):
    """Ranges, choices, rules between flags, paths and the tokenizer all at once (the
    tokenizer's and the mock-data rules were raised one at a time before)."""
    afile = tmp_path / "a_file"
    afile.write_text("")
    err = refusal(
        [
            "--data-path",
            str(tmp_path / "d"),
            "--clip-grad",
            "-1",
            "--adam-beta1",
            "1.5",
            "--lr",
            "0.1",
            "--min-lr",
            "0.5",
            "--tensorboard-dir",
            str(afile),
            "--split",
            "0,0,0",
            "--async-save",
            "--num-layers",
            "3",
            "--pipeline-model-parallel-size",
            "2",
            "--world-size",
            "2",
            "--dry-run",
        ],
        capsys,
        monkeypatch,
    )
    for text in (
        "--clip-grad must be >= 0",
        "--adam-beta1 must be in [0, 1)",
        "--min-lr 0.5 is above",
        "--tensorboard-dir",
        "--split '0,0,0'",
        "--async-save needs",
        "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2",
        "--data-path: missing",
        "--data-path needs --tokenizer-type",
    ):
        assert text in err, (text, err)
    assert err.count("error: invalid configuration") == 1


def test_an_unknown_choice_is_refused_by_the_parser(capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        pretrain.main(OK + ["--timing-log-level", "3"])
    assert e.value.code == 2
    assert "--timing-log-level: invalid choice: 3" in capsys.readouterr().err


def test_choices_of_a_config_built_in_code_come_from_the_literal_types():
    from megatron_ul.config import resolve
    from megatron_ul.config_rules import problems

    cfg = resolve(Config())
    cfg.data.mock_data, cfg.model.vocab_size = True, 100
    cfg.model.normalization, cfg.train.lr_decay_style = "BatchNorm", "step"  # type: ignore[assignment]
    found = problems(cfg)
    assert "--normalization must be one of LayerNorm, RMSNorm (got 'BatchNorm')" in found
    assert "--lr-decay-style must be one of constant, linear, cosine (got 'step')" in found


def test_every_numeric_flag_declares_a_range():
    """A new int or float flag must say which values it takes (config_rules.RANGES)."""
    numeric, sections = set(), typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        for name, annotation in typing.get_type_hints(sections[section.name]).items():
            types = set(typing.get_args(annotation)) | {annotation}
            if types & {int, float, list[int]} and bool not in types:
                numeric.add(f"{section.name}.{name}")
    assert numeric - set(RANGES) - JUDGED_BY_RULES == set()
    assert set(RANGES) <= numeric  # no entry for a field that does not exist


@pytest.mark.parametrize(
    "flags",
    [
        ["--clip-grad", "0"],
        ["--lr", "0", "--min-lr", "0"],
        ["--eval-interval", "0"],
        ["--eval-iters", "0"],
        ["--vocab-size", "2"],
        ["--lr-warmup-iters", "9"],
    ],
    ids=lambda f: " ".join(f),
)
def test_edge_values_with_a_megatron_meaning_are_accepted(flags):
    pretrain.configure(OK + flags, world_size=1)


def test_eval_iters_0_skips_evaluation(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = OK + [
        "--train-iters",
        "2",
        "--eval-interval",
        "1",
        "--eval-iters",
        "0",
        "--log-interval",
        "1",
    ]
    assert pretrain.main(argv) == 0
    assert "validation" not in capsys.readouterr().out


def test_every_rank_of_a_launch_reports_the_problems(tmp_path):
    """Two ranks of pretrain_gpt.py as srun starts them (no launcher in between): each prints
    the report and exits 2, before any process group exists."""
    env = dict(
        os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"
    )  # a port nobody serves: a rendezvous would fail, not hang
    ranks = [
        subprocess.Popen(
            [sys.executable, "pretrain_gpt.py", *OK, "--lr", "-1", "--split", "abc"],
            cwd=ROOT,
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for rank in ranks:
        out, err = rank.communicate(timeout=120)
        assert rank.returncode == 2, err
        assert "--lr must be >= 0 (got -1.0)" in err and "--split 'abc'" in err
        assert "Traceback" not in err and "iteration" not in out
