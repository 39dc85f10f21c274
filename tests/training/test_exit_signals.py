"""--exit-signal-handler as the Slurm scripts use it: SIGUSR1 (the #SBATCH --signal time-limit
warning) saves and exits 0 like SIGTERM, and a signal that arrives while the model is still being
built is not fatal: training stops after its first iteration, saved."""

import os
import signal
import subprocess
import sys

from megatron_ul.checkpoint import files
from tests.checkpoint.runs import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_and_signal(save: str, sig: int, when: str) -> tuple[int, str]:
    """Start a one-process run, send `sig` when a line containing `when` is printed."""
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
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if when in line:
            proc.send_signal(sig)
            break
    out = "".join(seen) + proc.communicate(timeout=120)[0]
    return proc.returncode, out


def test_signal_during_start_up_stops_after_the_first_iteration(tmp_path):
    save = str(tmp_path / "ckpt")
    # "parameters on rank 0" is logged after the model is built, before the optimizer, the
    # data and the training loop exist
    code, out = run_and_signal(save, signal.SIGUSR1, "parameters on rank 0")
    assert code == 0, out
    assert files.read_tracker(save) == 1
    assert "exiting at iteration 1 (SIGUSR1)" in out
