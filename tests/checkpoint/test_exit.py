"""--exit-signal-handler: SIGTERM (Slurm preemption) saves at the end of the current iteration
and exits 0; --exit-interval saves and stops."""

import os
import signal
import subprocess
import sys

import pytest

from megatron_ul.checkpoint import files
from tests.checkpoint.runs import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    "fmt",
    [[], ["--ckpt-format", "torch_dist", "--async-save", "--save-interval", "2"]],
    ids=["torch", "torch_dist-async"],
)
def test_sigterm_saves_and_exits_zero(tmp_path, fmt):
    """With --async-save (saving every 2 iterations in the background too) the exit save is
    completed before the process exits 0."""
    save = str(tmp_path / "ckpt")
    cmd = [
        sys.executable,
        "pretrain_gpt.py",
        *TINY,
        "--train-iters",
        "100000",
        "--log-interval",
        "1",
        "--save",
        save,
        "--exit-signal-handler",
        *fmt,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    seen = []
    for line in proc.stdout:  # wait until training is under way
        seen.append(line)
        if "iteration      3/" in line:
            proc.send_signal(signal.SIGTERM)
            break
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, "".join(seen) + out
    assert "exiting at iteration" in out and "(SIGTERM)" in out
    iteration = files.read_tracker(save)
    assert iteration is not None and 3 <= iteration < 100000
    assert f"saved checkpoint at iteration {iteration}" in out


def test_exit_interval_saves_and_stops(tmp_path, single_rank):
    from megatron_ul.training.pretrain import configure, setup

    save = str(tmp_path / "ckpt")
    losses = setup(
        configure(TINY + ["--train-iters", "10", "--exit-interval", "3", "--save", save], 1)
    ).train()
    assert len(losses) == 3 and files.read_tracker(save) == 3
