#!/usr/bin/env python
"""Requeue trials: kill -9 a training run during back-to-back saves, then start it again as a
requeued job does (--load D --save D); the restart must exit 0 with no person in between.

    python -m tools.checkpoint.requeue_trial --trials 10 [--ckpt-format torch_dist [--async-save]]

Each trial: a child trains a small model saving every iteration into a fresh directory; once its
first save is published it is killed with SIGKILL after a random 0-1.5 s; the requeue trains
three more iterations from the tracker's. Prints one line per trial (the tracker, whether a
publish intent was left, the requeue's exit status and its recovery line) and a summary.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = [
    "--mock-data",
    "--vocab-size",
    "1000",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--lr",
    "1e-3",
    "--log-interval",
    "1000",
    "--lr-decay-iters",
    "100000",
    "--distributed-timeout-minutes",
    "2",
]
TRACKER = "latest_checkpointed_iteration.txt"


def trial(d: str, flags: list[str], rng: random.Random, env: dict) -> tuple[bool, bool, str]:
    """(requeue exited 0, it recovered an interrupted save, the line to print)."""
    shutil.rmtree(d, ignore_errors=True)
    child = subprocess.Popen(
        [sys.executable, "pretrain_gpt.py", *MODEL, *flags, "--save", d, "--save-interval", "1"]
        + ["--train-iters", "100000"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while time.time() < deadline and not os.path.exists(os.path.join(d, TRACKER)):
        time.sleep(0.05)
    time.sleep(rng.uniform(0, 1.5))
    child.send_signal(signal.SIGKILL)
    child.wait()
    tracker = open(os.path.join(d, TRACKER)).read().strip()
    intent = any(".publish-" in n for n in os.listdir(d))
    r = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *MODEL, *flags, "--load", d, "--save", d]
        + ["--train-iters", str(int(tracker) + 3)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = [line for line in r.stdout.splitlines() if "interrupted save" in line]
    line = f"tracker {tracker}, intent left {intent}, requeue exit {r.returncode}"
    if said:
        line += " | " + said[0].split(" ", 2)[-1][:160]
    if r.returncode:
        line += " | " + (r.stderr.strip().splitlines() or [""])[-1][:300]
    shutil.rmtree(d, ignore_errors=True)
    return r.returncode == 0, bool(said), line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--dir", default="/tmp/megatron_ul_requeue_trial")
    p.add_argument("--ckpt-format", default="torch", choices=("torch", "torch_dist"))
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args(argv)
    flags = ["--ckpt-format", a.ckpt_format] + (["--async-save"] if a.async_save else [])
    rng = random.Random(a.seed)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["MASTER_PORT"] = str(29500 + rng.randint(0, 999))
    ok = recovered = 0
    for t in range(a.trials):
        passed, found, line = trial(os.path.join(a.dir, f"t{t}"), flags, rng, env)
        ok, recovered = ok + passed, recovered + found
        print(f"trial {t}: {line}", flush=True)
    print(
        f"{' '.join(flags)}: the requeue exited 0 in {ok} of {a.trials} trials; "
        f"{recovered} finished or rolled back an interrupted save"
    )
    return 0 if ok == a.trials else 1


if __name__ == "__main__":
    sys.exit(main())
