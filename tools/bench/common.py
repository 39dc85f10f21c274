"""Shared by the benchmarks: spawn gloo ranks (one thread each), machine info, and writing a
benchmark's section of docs/benchmarks.md (each benchmark owns the text between its markers)."""

from __future__ import annotations

import datetime
import os
import platform
import sys

import torch

from tools.local_ranks import run_on_local_ranks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO_ROOT, "docs", "benchmarks.md")
HEADER = (
    "# Benchmarks\n\nEach section is written by the script named in it "
    "(`--write-docs`); numbers are from one run on the machine described.\n"
)


def run_ranks(fn, world: int, *args, timeout: float = 1800.0) -> list:
    """fn(rank, world, *args) on `world` spawned gloo ranks, one thread each; rank order."""
    return run_on_local_ranks(
        fn, world, *args, timeout=timeout, collective_timeout=datetime.timedelta(minutes=30)
    )


def machine_info() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores visible, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {platform.system()} {platform.release()}"
    )


def write_section(name: str, body: str, path: str = DOCS) -> None:
    """Replace (or append) the section between this benchmark's markers in `path`
    (docs/benchmarks.md unless told otherwise)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = open(path).read() if os.path.exists(path) else HEADER
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def report(
    section: str, title: str, setup: str, table: str, conclusion: str = "", write_docs: bool = False
) -> str:
    """Print a benchmark's section (title, setup, machine, command, table, conclusion) and,
    with write_docs, put it between the section's markers in docs/benchmarks.md."""
    body = (
        f"## {title}\n\n{setup}\n\nMachine: {machine_info()}\n\n"
        f"Command: `{command_line()}`\n\n{table}\n"
    )
    if conclusion:
        body += f"\n{conclusion}\n"
    print(body)
    if write_docs:
        write_section(section, body)
    return body


def command_line() -> str:
    """How this benchmark was run, as `python -m tools.bench.NAME ARGS` (from the repo root)."""
    module = os.path.splitext(os.path.relpath(sys.argv[0], REPO_ROOT))[0].replace(os.sep, ".")
    return "python -m " + " ".join([module] + sys.argv[1:])


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def timed_training(rank, world, argv: list[str], warmup: int, iters: int, timing: bool):
    """Train with pretrain_gpt.py's flags on this rank; returns (seconds per iteration,
    {phase: seconds per iteration}) measured after `warmup` iterations. With timing on, the
    phases of --timing-log-level 1 are timed (forward, backward, all-to-all, ...)."""
    import time

    from megatron_ul.training.pretrain import configure, setup
    from megatron_ul.training.step import train_step

    cfg = configure(argv + (["--timing-log-level", "1"] if timing else []), world)
    trainer = setup(cfg)
    timers = trainer.timers  # the model's all-to-alls report here too

    def step():
        train_step(
            trainer.model,
            trainer.optimizer,
            next(trainer.train_batches),
            clip_grad=cfg.train.clip_grad,
            timers=timers,
        )

    for _ in range(warmup):
        step()
    timers.pop()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    per_iter = (time.perf_counter() - start) / iters
    return per_iter, {name: s / iters for name, s in timers.pop()[0].items()}
