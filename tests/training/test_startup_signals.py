"""A SIGTERM or SIGUSR1 during start-up (while torch is imported, before the flags are parsed)
does not kill a rank: with --exit-signal-handler it trains one iteration, saves and exits 0, so
the Slurm scripts requeue it (tests/slurm covers the scripts); without the flag the signal takes
its default effect once the flags are parsed, as in Megatron-LM."""

import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = [
    "--mock-data",
    "--vocab-size",
    "64",
    "--num-layers",
    "1",
    "--hidden-size",
    "16",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "8",
    "--train-iters",
    "5",
    "--log-interval",
    "1",
]


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler installed for `sig` (its SigCgt mask)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


def _signal_during_start_up(sig: signal.Signals, flags: list[str]) -> subprocess.CompletedProcess:
    """Start pretrain_gpt.py and send `sig` as soon as its handler exists: the process is then
    still importing torch, seconds before its flags are parsed."""
    # Without an inherited MASTER_PORT the one-process run picks a free port of its own.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WORLD_SIZE="1")
    proc = subprocess.Popen(
        [sys.executable, "pretrain_gpt.py", *MODEL, *flags],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not _catches(proc.pid, sig):
        assert proc.poll() is None and time.monotonic() < deadline, "no handler installed"
        time.sleep(0.001)
    with open(f"/proc/{proc.pid}/maps") as maps:
        assert "libtorch" not in maps.read()  # torch is not even loaded yet
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_sigterm_while_importing_saves_after_the_first_iteration(tmp_path):
    r = _signal_during_start_up(
        signal.SIGTERM, ["--exit-signal-handler", "--save", str(tmp_path / "ckpt")]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exiting at iteration 1 (SIGTERM)" in r.stdout, r.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_sigusr1_while_importing_without_the_handler_flag_takes_its_default_effect():
    r = _signal_during_start_up(signal.SIGUSR1, [])
    assert r.returncode == -signal.SIGUSR1, r.stderr[-3000:]
    assert "SIGUSR1 received during start-up (no --exit-signal-handler)" in r.stderr
    assert "iteration" not in r.stdout
