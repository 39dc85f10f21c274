"""Runs people can look at: a real (tiny) training run's TensorBoard events and its Weights &
Biases offline run hold the losses the trainer returned; tools/plot_runs.py draws and
tabulates them; --wandb-* flags fail early, naming the flag."""

from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from megatron_ul.config import ConfigError
from megatron_ul.training.pretrain import configure, setup
from tests.distributed import run_distributed

ITERS = 6
ARGV = [
    "--mock-data", "--vocab-size", "128", "--num-layers", "1", "--hidden-size", "32",
    "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "1e-3",
    "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
    "--attention-dropout", "0", "--hidden-dropout", "0",
]  # fmt: skip


def _train(rank, world, argv, env):
    os.environ.update(env)
    trainer = setup(configure(argv, world))
    return trainer.train()


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """One run logging to TensorBoard and (offline) to W&B: (losses, tb dir, W&B dir)."""
    pytest.importorskip("wandb")
    root = tmp_path_factory.mktemp("logged_run")
    tb, wb = str(root / "tb"), str(root / "wb")
    argv = ARGV + ["--tensorboard-dir", tb, "--wandb-project", "ul-test"]
    argv += ["--wandb-exp-name", "tiny", "--wandb-save-dir", wb]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    losses = run_distributed(_train, 1, argv, env)[0]
    return losses, tb, wb


def test_tensorboard_and_wandb_hold_the_trainers_scalars(logged_run):
    from tests.training.wandb_records import read_offline_run
    from tools.plot_runs import read_scalars

    losses, tb, wb = logged_run
    scalars = read_scalars(tb)
    steps, values = scalars["lm loss"]
    assert list(steps) == list(range(1, ITERS + 1))
    # TensorBoard keeps float32
    np.testing.assert_allclose(values, np.float32(losses), rtol=0, atol=0)
    assert list(scalars["lm loss validation"][0]) == [3, 6]
    assert list(scalars["lm loss vs samples"][0]) == [4 * s for s in range(1, ITERS + 1)]

    run = read_offline_run(wb)
    assert (run["project"], run["name"]) == ("ul-test", "tiny")
    assert run["config"]["model"]["hidden_size"] == 32  # the run's configuration
    assert run["config"]["logging"]["wandb_project"] == "ul-test"
    history = run["history"]
    assert sorted(history) == list(range(1, ITERS + 1))
    assert [history[s]["lm loss"] for s in range(1, ITERS + 1)] == losses  # full precision
    tb_tags = {tag for tag in scalars if not tag.endswith(" vs samples")}
    for step in range(1, ITERS + 1):
        row = {tag: v for tag, v in history[step].items()}
        expected = {tag for tag in tb_tags if step in scalars[tag][0]}
        assert set(row) == expected, step  # the same scalars as TensorBoard, step by step
        for tag in expected:
            tb_steps, tb_values = scalars[tag]
            tb_value = tb_values[list(tb_steps).index(step)]
            assert np.float32(row[tag]) == np.float32(tb_value), (tag, step)


def test_plot_runs_draws_png_and_svg_and_tabulates_differences(logged_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from matplotlib import image

    from tools import plot_runs

    losses, tb, _ = logged_run
    # a second run: the same events with every loss moved by a known amount
    from torch.utils.tensorboard import SummaryWriter

    other = str(tmp_path / "other")
    writer = SummaryWriter(log_dir=other)
    shifts = [0.0, 0.25, 0.0, -0.5, 0.125, 0.0]
    for step, (loss, shift) in enumerate(zip(losses, shifts), start=1):
        writer.add_scalar("lm loss", loss + shift, step)
    writer.close()

    png, svg, table = (str(tmp_path / n) for n in ("f.png", "f.svg", "t.md"))
    argv = [f"ours={tb}", f"shifted={other}", "--reference", "ours", "--table", table]
    assert plot_runs.main(argv + ["--output", png]) == 0
    assert (
        plot_runs.main([f"ours={tb}", "--output", svg, "--x", "tokens", "--seq-length", "16"]) == 0
    )
    pixels = image.imread(png)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 400
    assert pixels[..., :3].std() > 0.01  # something was drawn
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    drawn = capsys.readouterr().out
    for panel in ("loss", "learning rate", "grad norm", "throughput", "peak memory"):
        assert panel in drawn
    rows = open(table).read().splitlines()
    shifted = next(r for r in rows if r.startswith("| shifted"))
    cells = [c.strip() for c in shifted.strip("|").split("|")]
    max_abs, at_step = cells[2].split()
    assert cells[1] == str(ITERS)
    assert math.isclose(float(max_abs), 0.5, rel_tol=1e-3) and at_step == "(4)"


def test_plot_runs_names_a_directory_without_events(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from tools import plot_runs

    assert plot_runs.main([str(tmp_path), "--output", str(tmp_path / "x.png")]) == 2
    assert f"{tmp_path}: no TensorBoard scalars" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--wandb-project", "p", "--wandb-save-dir", "d"],
            "--wandb-project needs --wandb-exp-name",
        ),
        (["--wandb-project", "p", "--wandb-exp-name", "e"], "needs --wandb-save-dir (or --save"),
        (["--wandb-exp-name", "e"], "--wandb-exp-name needs --wandb-project"),
    ],
)
def test_wandb_flags_checked_before_anything_starts(extra, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")):
        configure(ARGV + extra, 1)


def test_missing_wandb_package_names_the_flag(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    argv = ARGV + ["--wandb-project", "p", "--wandb-exp-name", "e", "--save", str(tmp_path)]
    with pytest.raises(ConfigError, match=r"--wandb-project p: the wandb package is not installed"):
        configure(argv, 1)


def _wandb_ranks(rank, world, argv, env):
    os.environ.update(env)
    setup(configure(argv, world)).train()


def test_only_the_last_stages_first_rank_writes_to_wandb(tmp_path):
    """PP 2: rank 1 holds the last stage and the loss; rank 0 must not start a W&B run."""
    pytest.importorskip("wandb")
    from tests.training.wandb_records import read_offline_run

    argv = ARGV + ["--pipeline-model-parallel-size", "2", "--num-layers", "2"]
    argv += ["--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-save-dir", str(tmp_path)]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    run_distributed(_wandb_ranks, 2, argv, env)
    run = read_offline_run(str(tmp_path))  # exactly one offline run
    assert sorted(run["history"]) == list(range(1, ITERS + 1))
