"""The GPU check's runner: its two modes (a GPU's shapes and the reduced CPU mode), the bounds
its rows are held to, and the section runner that prints each row as it comes, turns an
exception into a FAIL row and keeps to the time budget (tools/gpu_check.py runs it)."""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_ul.training.memory_estimator import GiB
from tools.bench.common import REPO_ROOT, write_section
from tools.gpu_check_results import ResultFiles, number, table_row
from tools.gpu_check_sdpa import recorded, summary

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
# The check must end within 8 minutes on one H200: its sections get this much from the start
# of the process, the rest is for the last writes and the interpreter's exit.
GPU_TIME_BUDGET_S = 8 * 60 - 30
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
    efficient_seq: int  # the efficient kernel's unit blocks (query and key rows)
    efficient_heads: tuple  # (query heads, kv heads, head dim): more than one head
    tile_seq: int  # the document tiles' sequence (several 512-token tiles)
    dropout_heads: tuple  # (query heads, kv heads, head dim); the sequence is the head dim
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
    GPU_TIME_BUDGET_S,
    attention_seq=4096,
    heads=(16, 4, 128),
    ring_seq=8192,
    ring_growth_seqs=(16384, 32768),
    documents_seq=131072,
    documents=10_000,
    window=4096,
    efficient_seq=1024,
    efficient_heads=(8, 2, 128),
    tile_seq=2048,
    dropout_heads=(16, 4, 128),
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
    efficient_seq=64,
    efficient_heads=(4, 2, 16),
    tile_seq=768,
    dropout_heads=(4, 2, 64),
)


class OutOfTime(Exception):
    """Raised by Check.need: the rest of a section is skipped with a SKIP row."""


@dataclass
class Section:
    key: str
    title: str
    header: list  # the last two columns are always "status" and "note"
    rows: Callable  # rows(check) -> iterator of rows (lists matching the header, or Row)
    estimate_s: float  # about how long it takes on one H200 (from its shapes)
    cap_s: float  # it may not start a case past this many seconds after its start
    note: str = ""
    backend_column: bool = False  # attention rows: the kernel that ran, before status


@dataclass
class Row:
    """A row with what its cells cannot say: the attention kernels that ran (SdpaRecorder
    counts) and numbers kept at full precision for the result file."""

    cells: list
    calls: Counter = field(default_factory=Counter)
    measured: dict = field(default_factory=dict)


class Check:
    """Runs sections, each isolated: a row is printed (flushed) and written to the result
    files as it comes; an exception anywhere in a section, its release of device memory
    included, becomes a FAIL row and the next section runs; after an error that leaves the
    CUDA context unusable (a sticky error: device-side assert, illegal address) the later
    sections are recorded as SKIP with that error instead of being run; cases that no longer
    fit the time budget (the whole run's, or the section's cap) are SKIP rows marked as
    skipped for time. With write_docs the docs' gpu-check section is rewritten after every
    section."""

    def __init__(
        self,
        mode: Mode,
        write_docs: bool = False,
        out=None,
        results: ResultFiles | None = None,
        time_budget_s: float | None = None,
        start: float | None = None,
    ):
        self.mode, self.write_docs = mode, write_docs
        self.out = out or sys.stdout
        self.results = results
        self.budget_s = mode.budget_s if time_budget_s is None else time_budget_s
        self.start = time.monotonic() if start is None else start  # the budget counts from here
        self.deadline = self.start + self.budget_s
        self.section_deadline = self.deadline
        # The budget binds on a GPU; CPU timings of the reduced mode depend on machine load,
        # so there it binds only when asked for.
        self.enforce_budget = mode.device == "cuda" or time_budget_s is not None
        self.counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
        self.skipped_for_time: list[str] = []
        self.cuda_lost: str | None = None  # the sticky CUDA error, once there is one
        self.section: Section | None = None
        self._row_start = self.start

    def left(self) -> float:
        return min(self.deadline, self.section_deadline) - time.monotonic()

    def need(self, seconds: float, what: str) -> None:
        """Skip the rest of the section unless about `seconds` (GPU estimate) remain, in the
        whole run's budget and in the section's cap."""
        if self.enforce_budget and self.left() < seconds:
            whole = self.deadline - time.monotonic()
            raise OutOfTime(
                f"skipped for time: {what} needs ~{seconds:.0f} s, {max(self.left(), 0):.0f} s "
                f"left ({max(whole, 0):.0f} s of the run's {self.budget_s:.0f} s budget); the "
                f"section's later cases were not run"
            )

    def print(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def run(self, section: Section) -> None:
        self.section = section
        header = ResultFiles.header_of(section)
        entry = None
        if self.results is not None:  # on disk at once: a crash shows which section it hit
            entry = self.results.begin_section(section)
            self._write()
        self.print(
            "\n".join(
                ["", f"### {section.title}", "", table_row(header)]
                + ["|" + "|".join("---" for _ in header) + "|"]
            )
        )
        start = self._row_start = time.monotonic()
        self.section_deadline = start + section.cap_s
        outcome = "ran"
        if self.cuda_lost is not None:
            outcome = "not run: CUDA context lost"
            self._emit(filled(len(header), section.key, "SKIP", f"not run: {self.cuda_lost}"))
        else:
            try:
                self.need(section.estimate_s, f"section {section.key}")
                for row in section.rows(self):
                    self._emit(row)
            except OutOfTime as e:
                outcome = "cut for time"
                self._emit(filled(len(header), section.key, "SKIP", str(e)), for_time=True)
            except Exception as e:
                outcome = "aborted"
                self._emit(filled(len(header), f"{section.key}: section aborted", "FAIL", _why(e)))
                self._probe_cuda(section, e)
            # after the traceback (and the tensors its frames hold) is gone
            try:
                release()
            except Exception as e:
                outcome = "aborted"
                self._emit(
                    filled(
                        len(header), f"{section.key}: release after the section", "FAIL", _why(e)
                    )
                )
                self._probe_cuda(section, e)
        seconds = time.monotonic() - start
        tail = f"{section.note + ' ' if section.note else ''}Section time: {seconds:.1f} s."
        self.print("\n" + tail)
        if entry is not None:
            entry["seconds"], entry["outcome"] = round(seconds, 2), outcome
            self._write()
        if self.write_docs:
            self.write_doc_sections(finished=False)
        self.section = None

    def _probe_cuda(self, section: Section, error: BaseException) -> None:
        """After an exception on a GPU: is the CUDA context still usable? A sticky error
        makes every later CUDA call fail; the later sections then are not run."""
        if self.mode.device != "cuda" or self.cuda_lost is not None:
            return
        try:
            torch.cuda.synchronize()
            probe = torch.ones(1, device="cuda")
            probe.add_(1)
            torch.cuda.synchronize()
        except Exception as e:
            self.cuda_lost = (
                f"the CUDA context is unusable since section {section.key} "
                f"({_why(error)}; probe: {_why(e)})"
            )

    def _emit(self, row, for_time: bool = False) -> None:
        if not isinstance(row, Row):
            row = Row(list(row))
        section = self.section
        assert section is not None, "rows are emitted inside Check.run"
        cells = list(row.cells)
        if section.backend_column:
            cells[-2:-2] = [summary(row.calls)]
        status = str(cells[-2])
        if status in self.counts:
            self.counts[status] += 1
        if for_time:
            self.skipped_for_time.append(f"{section.key}: {cells[0]}")
        self.print(table_row(cells))
        if self.results is not None:
            now = time.monotonic()
            self.results.add_row(
                _row_record(section, ResultFiles.header_of(section), cells, row, for_time)
                | {"at_s": round(now - self.start, 2), "seconds": round(now - self._row_start, 2)}
            )
            self._row_start = now
            self._write()

    def _write(self) -> None:
        """Rewrite the result files; a full disk must not stop the measurements."""
        assert self.results is not None
        try:
            self.results.write()
        except OSError as e:
            self.print(f"(result files not written: {e})")

    def summary(self) -> str:
        c = self.counts
        return f"{c['PASS']} PASS, {c['FAIL']} FAIL, {c['SKIP']} SKIP."

    def finish(self, state: str = "complete") -> None:
        """The last write of the result files (and the docs' section, with write_docs)."""
        if self.results is not None:
            self.results.record["state"] = state
            self._write()
        if self.write_docs:
            self.write_doc_sections(finished=state == "complete")

    def write_doc_sections(self, finished: bool) -> None:
        if self.results is None:
            return
        body = self.results.markdown(heading="##")
        if not finished and self.results.record["state"] == "complete":
            body += "\n\n**Incomplete: the run stopped or is still running.**"
        write_section("gpu-check", body, BENCHMARKS_DOC)
        write_section("gpu-check", body, GPU_DOC)


def _why(e: BaseException) -> str:
    """'Type: first line (file:line)' of an exception, for a FAIL row's note."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{type(e).__name__}: {first}{where}"


def _row_record(section: Section, header: list, cells: list, row: Row, for_time: bool) -> dict:
    columns = dict(zip(header[1:-2], cells[1:-2]))
    bound = next((cells[i] for i, h in enumerate(header) if "bound" in str(h).lower()), None)
    measured = {
        h: value
        for h, cell in columns.items()
        if "bound" not in str(h).lower() and (value := number(cell)) is not None
    }
    measured.update(row.measured)
    return {
        "section": section.key,
        "case": str(cells[0]),
        "verdict": str(cells[-2]),
        "note": str(cells[-1]),
        "bound": bound,
        "values": columns,
        "measured": measured,
        "sdpa_backend": recorded(row.calls),
        "sdpa_calls": dict(row.calls),
        "skipped_for_time": for_time,
        "cells": [str(c) for c in cells],
    }


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


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / GiB if device == "cuda" else None


def gib(x: float | None) -> str:
    return f"{x:.2f}" if x is not None else "-"


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def mib(x: float | None) -> str:
    return f"{x:.0f}" if x is not None else "-"
