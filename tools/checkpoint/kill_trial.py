#!/usr/bin/env python
"""Fault-injection trials of checkpointing: kill -9 during saves, corrupted files, a full disk.

    python -m tools.checkpoint.kill_trial --trials 30 [--dir /tmp/kill_trial]
        [--ckpt-format torch_dist [--async-save]]              # kill trials of one format
    python -m tools.checkpoint.kill_trial --suite [--trials 4]  # every fault, every format

Kill: a child saves checkpoints back to back into one directory (every iteration twice, so
half of the saves replace an existing iteration, with --overwrite-checkpoints), is killed with
SIGKILL after a random delay, then the real trainer (setup() with --load) must load an
iteration at least the last one the child reported saved.
Corruption (--suite): each kind of file of the newest iteration (and the tracker) truncated to
half, one byte flipped in the middle, or deleted; the load must be refused naming the damaged
file, or load exactly what was saved.
Disk full (--suite): the child saves new iterations into a small tmpfs (sized at random between
1.2 and 2.8 checkpoints; as root, else RLIMIT_FSIZE) until a save fails; the error must name
the cause, no temporary directory may be left, and the last reported save must load.
Held: the trial's condition is met; failed: it is not. Prints Markdown tables.
"""

import argparse
import os
import random
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = [
    "--mock-data",
    "--vocab-size",
    "1000",
    "--num-layers",
    "4",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--train-iters",
    "1000000",
    "--log-interval",
    "1000000",
]


def child(
    directory: str, fmt: list[str], background: bool, write_delay: float, fill: int = 0
) -> None:
    """Save forever: iterations t+1, t+1, t+2, t+2, ... after the tracker's t. With
    --async-save each save is written in the background and completed just before the next
    one starts ("writing N" once it is under way, "saved N" once the tracker names it).
    fill > 0: save iterations 1, 2, ... (each once) until `fill` saves completed or one failed
    ("failed N <message>"), then return."""
    from megatron_ul.checkpoint import files
    from megatron_ul.checkpoint.training.save import save_checkpoint
    from megatron_ul.training.pretrain import configure, setup

    if fill:
        fill_directory(directory, fmt, background, fill)
        return
    if write_delay:  # a slow file system: the background writer sleeps before writing
        from torch.distributed.checkpoint import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def slow(self, plan, planner):
            time.sleep(write_delay)
            return write_data(self, plan, planner)

        # patched on purpose: a slower disk, so that the kill lands mid-write
        FileSystemWriter.write_data = slow  # type: ignore[method-assign]
    trainer = setup(configure(MODEL + fmt + ["--save", directory, "--overwrite-checkpoints"]))
    start = files.read_tracker(directory) or 0
    print("ready", flush=True)
    pending = None
    for n in range(2, 10**6):
        iteration = start + n // 2
        if pending is not None:
            pending.complete()
            print(f"saved {pending.iteration}", flush=True)
        print(f"saving {iteration}", flush=True)
        result = save_checkpoint(
            trainer.cfg,
            trainer.model,
            trainer.optimizer,
            trainer.scheduler,
            iteration,
            background=background,
        )
        if background:
            pending = result
            print(f"writing {iteration}", flush=True)
        else:
            print(f"saved {iteration}", flush=True)


def fill_directory(directory: str, fmt: list[str], background: bool, saves: int) -> None:
    from megatron_ul.checkpoint.files import CheckpointError
    from megatron_ul.checkpoint.training.save import save_checkpoint
    from megatron_ul.training.pretrain import configure, setup

    trainer = setup(configure(MODEL + fmt + ["--save", directory]))
    print("ready", flush=True)
    for iteration in range(1, saves + 1):
        print(f"saving {iteration}", flush=True)
        try:
            result = save_checkpoint(
                trainer.cfg,
                trainer.model,
                trainer.optimizer,
                trainer.scheduler,
                iteration,
                background=background,
            )
            if background:
                result.complete()
        except CheckpointError as e:
            print(f"failed {iteration} " + str(e).replace("\n", " "), flush=True)
            return
        print(f"saved {iteration}", flush=True)


def start_child(
    directory: str,
    fmt: list[str],
    background: bool,
    write_delay: float = 0.0,
    fill: int = 0,
    file_size_limit: int = 0,
):
    """The child process, once it is ready to save."""
    # the child picks its own rendezvous port (this process holds one after the first check)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    child_cmd = [
        sys.executable,
        "-m",
        "tools.checkpoint.kill_trial",
        "--child",
        directory,
        "--write-delay",
        str(write_delay),
        "--fill",
        str(fill),
        "--file-size-limit",
        str(file_size_limit),
        *fmt,
    ] + (["--async-save"] if background else [])
    proc = subprocess.Popen(
        child_cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT
    )
    assert proc.stdout is not None  # stdout=PIPE
    first = [proc.stdout.readline()]
    while first[-1] and first[-1].strip() != "ready":
        first.append(proc.stdout.readline())
    assert first[-1], f"child failed to start: {''.join(first)}"
    return proc


def outcome(proc, seen: str = "") -> dict:
    """Kill the child (SIGKILL: no cleanup of any kind) and read what it reported (`seen`:
    what the caller already read of its output)."""
    proc.kill()
    proc.wait()
    lines = (seen + proc.stdout.read()).split()
    saved = [int(v) for k, v in zip(lines[::2], lines[1::2]) if k == "saved"]
    mid_save = len(lines) >= 2 and lines[-2] in ("saving", "writing")
    return {"last_saved": saved[-1] if saved else None, "mid_save": mid_save, "saves": len(saved)}


def limit_file_size(limit: int) -> None:
    """No file written larger than `limit` bytes: writes fail with EFBIG (SIGXFSZ ignored)."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def one_trial(
    directory: str, max_delay: float, rng: random.Random, fmt: list[str], background: bool
) -> dict:
    proc = start_child(directory, fmt, background)
    delay = rng.uniform(0.0, max_delay)
    time.sleep(delay)
    return {"delay": delay, **outcome(proc)}


def load_and_release(directory: str, inspect):
    """inspect(the trainer loaded from `directory`), then the process groups are destroyed (a
    process creating groups for every trial runs out of threads)."""
    from megatron_ul.initialize import shutdown
    from megatron_ul.training.pretrain import configure, setup

    try:
        return inspect(setup(configure(MODEL + ["--load", directory])))
    finally:
        shutdown()
        os.environ.pop("MASTER_PORT", None)  # the next group gets a fresh port


def check_loadable(directory: str, last_saved) -> tuple[bool, str]:
    """The trainer loads `directory` (any format) at an iteration >= the last reported save."""
    try:
        loaded = load_and_release(directory, lambda trainer: trainer.start_iteration)
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"
    if last_saved is not None and loaded < last_saved:
        return False, f"loaded iteration {loaded} < last reported save {last_saved}"
    return True, f"iteration {loaded}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--dir", default="/tmp/megatron_ul_kill_trial")
    p.add_argument("--max-delay", type=float, default=2.0, help="seconds after start-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-format", default="torch", choices=("torch", "torch_dist"))
    p.add_argument(
        "--async-save",
        action="store_true",
        help="torch_dist written in the background, completed before the next save",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--write-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--fill", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--file-size-limit", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument(
        "--suite",
        action="store_true",
        help="kill, corruption and disk-full trials "
        "of both formats and --async-save; --trials kill trials per format",
    )
    a = p.parse_args()
    fmt = ["--ckpt-format", a.ckpt_format]
    if a.child:
        if a.file_size_limit:
            limit_file_size(a.file_size_limit)
        child(a.child, fmt, a.async_save, a.write_delay, a.fill)
        return 0
    if a.suite:
        from tools.checkpoint.fault_trials import suite

        return suite(a.dir, a.trials, a.seed, a.max_delay)
    import logging

    logging.basicConfig(level=logging.ERROR)
    shutil.rmtree(a.dir, ignore_errors=True)
    rng, results = random.Random(a.seed), []
    for trial in range(a.trials):
        r = one_trial(a.dir, a.max_delay, rng, fmt, a.async_save)
        r["loadable"], r["detail"] = check_loadable(a.dir, r["last_saved"])
        results.append(r)
        print(
            f"trial {trial + 1:3d}: killed after {r['delay']:.2f}s "
            f"{'mid-save' if r['mid_save'] else 'between saves'}, last reported save "
            f"{r['last_saved']}, loadable: {r['loadable']} ({r['detail']})",
            flush=True,
        )
    leftovers = sorted(n for n in os.listdir(a.dir) if ".tmp-" in n or ".old-" in n or ".del-" in n)
    ok = sum(r["loadable"] for r in results)
    print(
        f"\n| trials | killed mid-save | loadable afterwards | unfinished dirs left |\n"
        f"|---|---|---|---|\n| {len(results)} | {sum(r['mid_save'] for r in results)} | "
        f"{ok} | {len(leftovers)} |"
    )
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
