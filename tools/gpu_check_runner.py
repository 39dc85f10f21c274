"""The GPU check's runner: its two modes (a GPU's shapes and the reduced CPU mode), the bounds
its rows are held to, and the section runner that prints each row as it comes, turns an
exception into a FAIL row and keeps to the time budget (tools/gpu_check.py runs it)."""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_ul.model import attention
from megatron_ul.training.memory_estimator import GiB
from tools.bench.common import REPO_ROOT, command_line, machine_info, write_section

HALF_PRECISION_LOSS_TOLERANCE = 2e-2  # as tests/optim/test_precision.py (fp16 vs fp32)
FP32_LOSS_TOLERANCE = 1e-5  # the project's fp32 bar (tests/model/test_fused_layers)
MEMORY_BOUND = 1.25  # max_memory_allocated <= 1.25 x the estimator's figure
RING_GROWTH_BOUND = 2.1  # ring memory per doubling of the local sequence
RING_VS_ONE_DEVICE_BOUND = 1.5  # ring vs one-device attention, same tokens per rank
SCOPE = (
    "Outside what one GPU can show: multi-rank NCCL, tensor parallelism (TP), sequence "
    "parallelism (SP: Ulysses and Megatron-SP), pipeline parallelism (PP) and the ring's "
    "communication; the ring rows run R virtual ranks in one process (their compute, "
    "with the messages handed over in memory)."
)
GPU_DOC = os.path.join(REPO_ROOT, "docs", "gpu.md")
BENCHMARKS_DOC = os.path.join(REPO_ROOT, "docs", "benchmarks.md")


@dataclass(frozen=True)
class Mode:
    device: str
    small: list  # the correctness model
    steps: int
    big: list  # the performance model (the 1.3B GPT on a GPU)
    lengths: tuple  # sequence lengths always measured
    longest_from: int  # doubling search for the longest that fits starts here
    longest_cap: int  # ... and stops here
    budget_s: float  # the whole check
    attention_seq: int
    heads: tuple  # (query heads, kv heads, head dim) of the attention rows
    ring_seq: int
    ring_growth_seqs: tuple
    documents_seq: int
    documents: int
    window: int
    offload_model: list = field(default_factory=list)


GPU = Mode(
    "cuda",
    [
        "--num-layers",
        "4",
        "--hidden-size",
        "1024",
        "--num-attention-heads",
        "16",
        "--num-query-groups",
        "4",
        "--seq-length",
        "2048",
        "--vocab-size",
        "32000",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
    ],
    6,
    [
        "--num-layers",
        "24",
        "--hidden-size",
        "2048",
        "--num-attention-heads",
        "16",
        "--vocab-size",
        "50257",
        "--position-embedding-type",
        "rope",
    ],
    (8192, 32768),
    65536,
    1 << 20,
    8 * 60 - 30,
    attention_seq=4096,
    heads=(16, 4, 128),
    ring_seq=8192,
    ring_growth_seqs=(16384, 32768),
    documents_seq=131072,
    documents=10_000,
    window=4096,
    offload_model=[
        "--num-layers",
        "8",
        "--seq-length",
        "8192",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "2",
    ],
)
CPU = Mode(
    "cpu",
    [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "8",
        "--num-query-groups",
        "2",
        "--seq-length",
        "32",
        "--vocab-size",
        "1000",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
    ],
    3,
    [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--vocab-size",
        "1000",
        "--position-embedding-type",
        "rope",
    ],
    (32, 64),
    128,
    256,
    240,
    attention_seq=64,
    heads=(4, 2, 16),
    ring_seq=64,
    ring_growth_seqs=(64, 128),
    documents_seq=256,
    documents=20,
    window=16,
)


class OutOfTime(Exception):
    """Raised by Check.need: the rest of a section is skipped with a SKIP row."""


@dataclass
class Section:
    key: str
    title: str
    header: list  # the last two columns are always "status" and "note"
    rows: Callable  # rows(check) -> iterator of rows (lists matching the header)
    needs_s: float  # about how long it takes on the GPU (the budget guard)
    note: str = ""


class Check:
    """Runs sections: prints each row as it comes (flushed), turns an exception into a FAIL
    row, skips what the time budget no longer allows, and (with write_docs) rewrites the
    docs' gpu-check section after every section, so a later crash keeps the earlier tables."""

    def __init__(self, mode: Mode, write_docs: bool, out=None):
        self.mode, self.write_docs = mode, write_docs
        self.out = out or sys.stdout
        self.deadline = time.monotonic() + mode.budget_s
        # The budget binds on a GPU; CPU timings of the reduced mode depend on machine load.
        self.enforce_budget = mode.device == "cuda"
        self.tables: list[str] = []
        self.counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
        self.started = datetime.datetime.now(datetime.timezone.utc)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def need(self, seconds: float, what: str) -> None:
        """Skip the rest of the section unless about `seconds` (GPU estimate) remain."""
        if self.enforce_budget and self.left() < seconds:
            raise OutOfTime(f"time budget: {self.left():.0f} s left, {what} needs ~{seconds:.0f} s")

    def print(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def run(self, section: Section) -> None:
        lines = [
            f"### {section.title}",
            "",
            table_row(section.header),
            "|" + "|".join("---" for _ in section.header) + "|",
        ]
        self.print("\n".join(["", *lines]))
        width = len(section.header)
        start = time.monotonic()
        try:
            self.need(section.needs_s, f"section {section.key}")
            for row in section.rows(self):
                lines.append(self._emit(row))
        except OutOfTime as e:
            lines.append(self._emit(filled(width, section.key, "SKIP", str(e))))
        except Exception as e:  # noqa: BLE001 - one failing section must not hide the others
            where = traceback.extract_tb(e.__traceback__)[-1]
            message = (
                f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''} "
                f"({os.path.basename(where.filename)}:{where.lineno})"
            )
            lines.append(
                self._emit(filled(width, f"{section.key}: section aborted", "FAIL", message))
            )
        release()  # after the traceback (and the tensors its frames hold) is gone
        tail = (
            f"{section.note + ' ' if section.note else ''}Section time: "
            f"{time.monotonic() - start:.1f} s."
        )
        self.print("\n" + tail)
        self.tables.append("\n".join(lines) + "\n\n" + tail)
        if self.write_docs:
            self.write(finished=False)

    def _emit(self, row: list) -> str:
        status = str(row[-2])
        if status in self.counts:
            self.counts[status] += 1
        line = table_row(row)
        self.print(line)
        return line

    def summary(self) -> str:
        c = self.counts
        return f"{c['PASS']} PASS, {c['FAIL']} FAIL, {c['SKIP']} SKIP."

    def body(self, finished: bool) -> str:
        mode = self.mode
        when = self.started.strftime("%Y-%m-%d %H:%M UTC")
        device = torch.cuda.get_device_name() if mode.device == "cuda" else "CPU (reduced mode)"
        flash = "installed" if attention.flash_attn_module() is not None else "not installed"
        state = (
            self.summary()
            if finished
            else "**Incomplete: the run stopped or is still running after the tables above.**"
        )
        return "\n\n".join(
            [
                "## GPU check (tools/gpu_check.py)",
                f"Run {when} on {device}. Machine: {machine_info()}; flash-attn {flash}.",
                f"Command: `{command_line()}`",
                SCOPE,
                *self.tables,
                state,
            ]
        )

    def write(self, finished: bool) -> None:
        body = self.body(finished)
        write_section("gpu-check", body, BENCHMARKS_DOC)
        write_section("gpu-check", body, GPU_DOC)


def table_row(cells: list) -> str:
    return "| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"


def filled(width: int, label: str, status: str, note: str) -> list:
    return [label] + [""] * (width - 3) + [status, note]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def release() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def peak_reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> Optional[float]:
    return torch.cuda.max_memory_allocated() / GiB if device == "cuda" else None


def gib(x: Optional[float]) -> str:
    return f"{x:.2f}" if x is not None else "-"


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def mib(x: Optional[float]) -> str:
    return f"{x:.0f}" if x is not None else "-"
