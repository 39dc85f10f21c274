"""The real sbatch scripts on a real Slurm cluster (tests/slurm/cluster.py: munged, slurmctld and
two slurmd nodes on this host), with a small model on CPU (gloo), SP=2 across the two nodes:

(a) a two-node job completes: loss falls, exit 0, no traceback in its log;
(b) a job warned of its time limit (SIGUSR1, as #SBATCH --signal sends it) and later preempted
    by a higher-priority job saves each time, is requeued, resumes, and its per-iteration losses
    equal the uninterrupted run's, bit for bit;
(c) a job killed at its time limit (no warning, no --exit-duration-in-mins) leaves its last
    checkpoint loadable: a resubmission on another layout (TP 2 instead of SP 2) resumes from it;
(d) one rank SIGKILLed: the whole job fails within seconds (not after the collective timeout),
    and a resubmission resumes from the last complete checkpoint, repeating the lost iterations
    exactly;
(e) SIGUSR1, then SIGTERM, each as soon as the starting ranks can catch it (on pretrain_gpt.py's
    first line, long before the process group exists): each start saves its first iteration
    and exits 0, the batch script requeues, the job completes.

The scripts save in the torch_dist format by default; (b) adds ASYNC_SAVE=1 (--async-save) and
(d) saves its first job with CKPT_FORMAT=torch, so its resubmission resumes across formats.

Opt-in (about 3 minutes; installs Debian's slurm-wlm packages as root where missing):
    RUN_SLURM_TESTS=1 python -m pytest -q -s tests/slurm
RUN_SLURM_TESTS=require (.ci/run) fails instead of skipping when Slurm cannot be set up.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.slurm.cluster import SlurmCluster, SlurmUnavailable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(
    not os.environ.get("RUN_SLURM_TESTS"),
    reason="real Slurm cluster (~3 min, installs slurm-wlm as root): set RUN_SLURM_TESTS=1",
)

SCRIPT_1B = "scripts/slurm/pretrain_gpt_1.2B_1M.sbatch"  # full recompute
SCRIPT_7B = "scripts/slurm/pretrain_gpt_7B_128K.sbatch"  # ZeRO-3
SCRIPT_30B = "scripts/slurm/pretrain_gpt_30B_128K.sbatch"  # ZeRO-3
VOCAB = 256
ITERS = 100
# The CPU recipe of docs/operations.md: a small model through the unchanged scripts.
CPU_ENV = {
    "NUM_LAYERS": "2",
    "HIDDEN_SIZE": "64",
    "NUM_HEADS": "4",
    "SEQ_LENGTH": "128",
    "MICRO_BATCH": "4",
    "PRECISION": "",
    "OMP_NUM_THREADS": "1",
    "TOKENIZER_TYPE": "NullTokenizer",
    "VOCAB_SIZE": str(VOCAB),
    "TRAIN_ITERS": str(ITERS),
    "SAVE_INTERVAL": "10",
}
# Two nodes, one rank each, no GPUs; test jobs share the nodes (--exclusive=user); the time-limit
# warning is sent by hand in (b) (`scancel --signal=USR1`, the path #SBATCH --signal takes).
CPU_SBATCH = [
    "--nodes=2",
    "--ntasks-per-node=1",
    "--gpus-per-node=0",
    "--exclusive=user",
    "--time=10",
    "--signal=USR1@0",
]
FLAGS = [
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-warmup-iters",
    "2",
    "--split",
    "98,2,0",
    "--log-interval",
    "1",
    "--timing-log-level",
    "0",
    "--distributed-timeout-minutes",
    "1",
]
ITERATION = re.compile(r"iteration +(\d+)/ *\d+ \| lm loss (\S+)")
TIMES: dict[str, float] = {}


def write_corpus(path: str, documents: int = 400) -> None:
    """Documents that count in steps (a, a+s, a+2s, ... mod V-1): a model learns them quickly,
    so the loss falls visibly within a hundred iterations."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(documents):
            a, s, n = rng.randrange(VOCAB - 1), rng.choice([1, 2, 3, 5, 7]), rng.randrange(100, 400)
            f.write(
                json.dumps({"text": " ".join(str((a + i * s) % (VOCAB - 1)) for i in range(n))})
                + "\n"
            )


@pytest.fixture(scope="module")
def cluster():
    start = time.monotonic()
    try:
        c = SlurmCluster(cpus_per_node=4, kill_wait=10, grace_time=30, cred_expire=10)
        c.start()
    except SlurmUnavailable as e:
        if os.environ.get("RUN_SLURM_TESTS") == "require":  # .ci/run: a skip would hide it
            raise
        pytest.skip(str(e))
    TIMES["cluster start (incl. install check)"] = time.monotonic() - start
    yield c
    c.stop()
    print("\nslurm test times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in TIMES.items()))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, cluster):
    d = tmp_path_factory.mktemp("slurm-runs")
    write_corpus(str(d / "corpus.jsonl"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.preprocess_data",
            "--input",
            str(d / "corpus.jsonl"),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            str(VOCAB),
            "--append-eod",
            "--output-prefix",
            str(d / "counting"),
            "--workers",
            "1",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return d


class Run:
    """One training run: its sbatch script, RUN_DIR and log(s) (one per submission)."""

    def __init__(self, cluster, workdir, name, script, env=None, sbatch=None, flags=None):
        self.cluster, self.name, self.script = cluster, name, script
        self.dir = workdir / name
        self.env = {
            **CPU_ENV,
            "DATA_PATH": str(workdir / "counting_text_document"),
            "RUN_DIR": str(self.dir),
            **(env or {}),
        }
        self.sbatch_args = [*CPU_SBATCH, *(sbatch or [])]
        self.flags = [*FLAGS, *(flags or [])]
        self.jobs: list[str] = []

    def submit(self, env=None, sbatch=None, flags=None) -> str:
        out = str(self.dir.parent / f"{self.name}-%j.out")
        job = self.cluster.sbatch(
            [
                *self.sbatch_args,
                *(sbatch or []),
                f"--output={out}",
                self.script,
                *self.flags,
                *(flags or []),
            ],
            env={**self.env, **(env or {})},
            cwd=ROOT,
        )
        self.jobs.append(job)
        return job

    def log(self, job=None) -> str:
        path = self.dir.parent / f"{self.name}-{job or self.jobs[-1]}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def losses(self, job=None) -> dict[int, str]:
        """iteration -> the loss as logged (%.6E); a later line for the same iteration wins."""
        return {int(i): loss for i, loss in ITERATION.findall(self.log(job))}

    def wait_for_iteration(self, iteration: int, job=None, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        pattern = re.compile(rf"iteration +{iteration}/")
        while not pattern.search(self.log(job)):
            state = self.cluster.state(job or self.jobs[-1])
            assert time.monotonic() < deadline, (
                f"no iteration {iteration}; {state}\n{self.log(job)}"
            )
            time.sleep(0.1)

    def wait(self, states, job=None, timeout: float = 300) -> dict:
        return self.cluster.wait(job or self.jobs[-1], states, timeout=timeout)

    def tracker(self) -> int:
        path = self.dir / "checkpoints" / "latest_checkpointed_iteration.txt"
        return int(path.read_text()) if path.exists() else 0

    def storage(self, iteration: int) -> str:
        """The format the checkpoint of `iteration` was written in (its metadata.json)."""
        meta = self.dir / "checkpoints" / f"iter_{iteration:07d}" / "metadata.json"
        return json.loads(meta.read_text()).get("storage", "torch")


def assert_clean(log: str) -> None:
    for bad in ("Traceback", "Failed to recv", "Connection was likely closed", "CANCELLED"):
        assert bad not in log, f"{bad!r} in the job log:\n{log}"


@pytest.fixture(scope="module")
def time_limit_run(cluster, workdir):
    """(c) is submitted first and runs beside the others: it needs a minute to reach its limit.
    The 'priority' partition: the preemption in (b) cannot touch it."""
    run = Run(
        cluster,
        workdir,
        "timelimit",
        SCRIPT_30B,
        env={"TRAIN_ITERS": "100000", "SAVE_INTERVAL": "20", "EXIT_DURATION_IN_MINS": "none"},
        sbatch=["--partition=priority", "--time=1"],
    )
    run.submit()
    run.started = time.monotonic()
    return run


@pytest.fixture(scope="module")
def reference(cluster, workdir, time_limit_run):
    """(a) the uninterrupted run every other curve is compared with."""
    start = time.monotonic()
    run = Run(cluster, workdir, "reference", SCRIPT_1B)
    run.submit()
    info = run.wait({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    TIMES["(a) uninterrupted job"] = time.monotonic() - start
    run.info = info
    return run


def test_two_node_job_completes_and_loss_falls(reference):
    log = reference.log()
    assert reference.info["JobState"] == "COMPLETED" and reference.info["ExitCode"] == "0:0", log
    assert "2 nodes x 1 ranks" in log and "world 2 = PP 1 × DP 1 × CP 1 × SP 2 × TP 1" in log
    losses = reference.losses()
    assert sorted(losses) == list(range(1, ITERS + 1)), log
    first, last = float(losses[1]), float(losses[ITERS])
    print(f"(a) loss {first:.3f} -> {last:.3f}")
    assert last < first - 1.0, log
    assert reference.tracker() == ITERS
    assert reference.storage(ITERS) == "torch_dist"  # the scripts' default format
    assert "ranks exited with status 0" in log and "requeueing" not in log
    assert_clean(log)
    # everything of the run under RUN_DIR: checkpoints, TensorBoard, a link to the job's log
    assert os.listdir(reference.dir / "tensorboard")
    assert (reference.dir / "logs" / f"{reference.jobs[0]}.out").read_text() == log


def test_killed_rank_fails_fast_and_resubmission_resumes(cluster, workdir, reference):
    """(d) SIGKILL one rank mid-run: srun --kill-on-bad-exit ends the step at once, the job
    fails; resubmitting the same script resumes from the last complete checkpoint. The first
    job saves in the old torch format, the resubmission loads it and saves torch_dist."""
    start = time.monotonic()
    run = Run(cluster, workdir, "killed", SCRIPT_7B)
    job = run.submit(env={"CKPT_FORMAT": "torch"})
    run.wait_for_iteration(25)
    pids = cluster.task_pids(job, 1, "pretrain_gpt.py")
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    killed_at = time.monotonic()
    info = run.wait({"FAILED", "COMPLETED", "CANCELLED", "TIMEOUT"}, timeout=120)
    failed_after = time.monotonic() - killed_at
    before = run.losses()
    saved = run.tracker()
    print(
        f"(d) job failed {failed_after:.1f} s after the SIGKILL (collective timeout 60 s); "
        f"logged up to iteration {max(before)}, last checkpoint {saved}"
    )
    assert info["JobState"] == "FAILED", run.log()
    assert failed_after < 60, "the job must fail within the 60 s collective timeout, not hang"
    assert "task 1: Killed" in run.log() and 20 <= saved <= max(before)
    assert run.storage(saved) == "torch"

    run.submit()
    info = run.wait({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    TIMES["(d) killed + resubmitted"] = time.monotonic() - start
    log = run.log()
    assert info["JobState"] == "COMPLETED", log
    assert f"loaded checkpoint {run.dir}/checkpoints/iter_{saved:07d} at iteration {saved}" in log
    after = run.losses()
    assert sorted(after) == list(range(saved + 1, ITERS + 1)), log
    redone = [i for i in before if i > saved]
    assert redone, "the kill should fall between two checkpoints"
    # the iterations lost with the kill are repeated exactly (bitwise resume)
    assert {i: after[i] for i in redone} == {i: before[i] for i in redone}
    # ZeRO-3 (7B script) reproduces the uninterrupted 1.2B-script curve
    curve = {**before, **after}
    diff = max(abs(float(curve[i]) - float(reference.losses()[i])) for i in curve)
    print(f"(d) max |loss - reference| over {len(curve)} iterations: {diff:.2e}")
    assert diff < 1e-5
    assert run.tracker() == ITERS and run.storage(ITERS) == "torch_dist"


def test_time_limit_kill_leaves_a_loadable_checkpoint(cluster, time_limit_run):
    """(c) no warning and no --exit-duration-in-mins: Slurm ends the job at its time limit
    (SIGTERM, then SIGKILL after KillWait); the ranks save on SIGTERM; a resubmission with
    another layout (TP=2 SP=1 instead of SP=2) reshards the checkpoint on load and resumes."""
    run = time_limit_run
    info = run.wait({"TIMEOUT", "COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    log = run.log()
    assert info["JobState"] == "TIMEOUT", log
    assert "DUE TO TIME LIMIT" in log and "exiting at iteration" in log, log
    losses = run.losses()
    saved = run.tracker()
    print(
        f"(c) killed at its 1-minute limit after iteration {max(losses)}; last checkpoint {saved}"
    )
    assert saved == max(losses), "the SIGTERM at the time limit saves the last iteration"
    assert run.storage(saved) == "torch_dist"

    # a few more iterations than the checkpoint's schedule planned: keep its LR schedule
    run.submit(
        env={"TRAIN_ITERS": str(saved + 3), "TP": "2"},
        sbatch=["--time=5"],
        flags=["--use-checkpoint-opt_param-scheduler"],
    )
    info = run.wait({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    TIMES["(c) time limit + resubmitted"] = time.monotonic() - run.started
    log = run.log()
    assert info["JobState"] == "COMPLETED", log
    assert f"loaded checkpoint {run.dir}/checkpoints/iter_{saved:07d} at iteration {saved}" in log
    assert "world 2 = PP 1 × DP 1 × CP 1 × SP 1 × TP 2" in log, log
    # torch_dist: each rank read the pieces of its TP half straight from the SP 2 checkpoint
    assert "layout differs from the checkpoint's" in log and "resharding" not in log, log
    resumed = run.losses()
    assert sorted(resumed) == [saved + 1, saved + 2, saved + 3], log
    # the weights were loaded, not re-initialised: the loss continues from where it was
    assert abs(float(resumed[saved + 1]) - float(losses[saved])) < 0.5
    assert float(resumed[saved + 1]) < float(losses[1]) - 1.0


def test_warned_then_preempted_job_resumes_with_identical_losses(
    cluster, workdir, reference, time_limit_run
):
    """(b) SIGUSR1 (the time-limit warning) mid-run: the ranks save and exit 0, the batch script
    requeues the job. Then a job in the higher-priority partition preempts it: SIGTERM, save,
    requeue by Slurm. Each restart resumes from its checkpoint; the losses equal (a)'s.
    With ASYNC_SAVE=1: the periodic saves are written in the background, and each exit waits
    for the save in flight and then completes its own before the ranks exit."""
    start = time.monotonic()
    run = Run(cluster, workdir, "preempted", SCRIPT_1B, env={"ASYNC_SAVE": "1"})
    job = run.submit()
    run.wait_for_iteration(10, job)
    assert cluster.scancel("--signal=USR1", job).returncode == 0
    cluster.wait(job, {"PENDING"}, timeout=120)  # requeued by its own batch script
    first = run.tracker()
    assert 10 <= first < ITERS, run.log()

    run.wait_for_iteration(first + 5, job)
    preemptor = cluster.sbatch(
        [
            "--partition=priority",
            "--nodes=2",
            "--exclusive",
            "--output=/dev/null",
            "--wrap",
            "sleep 1",
        ]
    )
    cluster.wait(job, {"PENDING"}, timeout=120)  # preempted and requeued
    second = run.tracker()
    assert first < second < ITERS, run.log()
    cluster.wait(preemptor, {"COMPLETED"}, timeout=60)

    info = run.wait({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    TIMES["(b) warned + preempted job"] = time.monotonic() - start
    log = run.log()
    print(f"(b) saved and requeued at iterations {first} (SIGUSR1) and {second} (preemption)")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", log
    assert f"exiting at iteration {first} (SIGUSR1)" in log
    assert f"exiting at iteration {second} (SIGTERM)" in log
    for iteration in (first, second):
        assert f"loaded checkpoint {run.dir}/checkpoints/iter_{iteration:07d}" in log
    assert run.losses() == reference.losses()  # every iteration, bit for bit (as logged)
    assert all(run.storage(i) == "torch_dist" for i in (first, second, ITERS))
    # --async-save took effect: rank 0 logs both lines; a synchronous save completes before
    # the next iteration, a background one at the earliest after it
    overlapped = [
        k
        for k in range(10, ITERS, 10)
        if (done := log.find(f"saved checkpoint at iteration {k} ")) >= 0
        and (after := re.search(rf"iteration +{k + 1}/", log)) is not None
        and after.start() < done
    ]
    print(f"(b) background saves completed after the next iteration: {overlapped}")
    assert overlapped, log


def _catches_in_every_task(cluster, job: str, sig: signal.Signals) -> bool:
    """Both ranks of `job` run and have a handler for `sig` installed (their SigCgt masks)."""
    pids = [p for rank in (0, 1) for p in cluster.task_pids(job, rank, "pretrain_gpt.py")]
    try:
        masks = []
        for pid in pids:
            with open(f"/proc/{pid}/status") as f:
                masks += [int(line.split()[1], 16) for line in f if line.startswith("SigCgt:")]
    except OSError:
        return False
    return len(masks) == 2 and all(mask >> (sig - 1) & 1 for mask in masks)


def _signal_during_start_up(cluster, run, job: str, sig: signal.Signals) -> int:
    """Send `sig` to the ranks (as #SBATCH --signal does) as soon as both can catch it, while
    they are still importing torch. Returns the number of iterations logged until then."""
    deadline = time.monotonic() + 180
    while not _catches_in_every_task(cluster, job, sig):
        assert time.monotonic() < deadline, f"{cluster.state(job)}\n{run.log(job)}"
        time.sleep(0.01)
    logged = len(ITERATION.findall(run.log(job)))
    assert cluster.scancel(f"--signal={sig.name.removeprefix('SIG')}", job).returncode == 0
    return logged


def test_signals_during_start_up_requeue_and_the_job_completes(cluster, workdir):
    """(e) SIGUSR1 while the ranks start (the time-limit warning arriving early), then SIGTERM
    while the requeued job starts: each time the ranks train one iteration, save and exit 0,
    the batch script requeues, and the third start completes the run."""
    start = time.monotonic()
    iters = 12
    run = Run(cluster, workdir, "startup", SCRIPT_1B, env={"TRAIN_ITERS": str(iters)})
    job = run.submit()
    before = [_signal_during_start_up(cluster, run, job, signal.SIGUSR1)]
    cluster.wait(job, {"PENDING"}, timeout=180)  # requeued by its own batch script
    assert run.tracker() == 1, run.log()
    before.append(_signal_during_start_up(cluster, run, job, signal.SIGTERM))
    cluster.wait(job, {"PENDING"}, timeout=180)
    assert run.tracker() == 2, run.log()
    info = run.wait({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    TIMES["(e) signals during start-up"] = time.monotonic() - start
    log = run.log()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", log
    assert before == [0, 1], log  # no iteration of that start had run when it was signalled
    assert "exiting at iteration 1 (SIGUSR1)" in log and "exiting at iteration 2 (SIGTERM)" in log
    assert log.count("requeueing job") == 2 and run.tracker() == iters
    assert sorted(run.losses()) == list(range(1, iters + 1))
    # slurmstepd announces a SIGTERM sent to a step as "STEP ... CANCELLED"; the ranks caught it
    for bad in ("Traceback", "Failed to recv", "Connection was likely closed"):
        assert bad not in log, f"{bad!r} in the job log:\n{log}"
