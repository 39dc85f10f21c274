"""The GPU check's result files: docs/results/gpu/<date>-<device>.json and its Markdown beside it.

Both are rewritten after every row (write to a temporary file, then rename), so a crash, a
kill or a lost CUDA context leaves every row measured until then on disk, marked unfinished.
The JSON (schema 1):

  schema, tool, command, started, updated, state ("running" | "complete" | "interrupted: ..."),
  mode ("gpu" | "cpu"), time_budget_s, environment {device, capability, memory_gib, torch,
  cuda, cudnn, flash_attn, python, machine},
  sections [{key, title, header, note, estimate_s, cap_s, seconds, outcome}],
  rows [{section, case, verdict, bound, values {column: cell}, measured {column: number},
         sdpa_backend, sdpa_calls {kernel: calls}, skipped_for_time, at_s,
         device, capability, torch, cuda, cudnn}],
  summary {PASS, FAIL, SKIP}, skipped_for_time ["section: case", ...]

`measured` holds the cells that read as numbers (units and thousands separators dropped);
`values` keeps every cell as printed. Each row repeats the device and versions so that rows
from several files can be pooled."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re

import torch

from tools.bench.common import REPO_ROOT, machine_info

RESULTS_DIR = os.path.join(REPO_ROOT, "docs", "results", "gpu")
SCHEMA = 1


def environment(device: str) -> dict:
    """The device and the versions a result depends on."""
    cuda = device == "cuda"
    props = torch.cuda.get_device_properties(0) if cuda else None
    try:
        import flash_attn

        flash = getattr(flash_attn, "__version__", "installed")
        if "stand_ins" in (getattr(flash_attn, "__file__", None) or ""):
            flash += " (the test suite's CPU stand-in)"
    except ImportError:
        flash = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "device": props.name if props is not None else "cpu",
        "capability": f"{props.major}.{props.minor}" if props is not None else None,
        "memory_gib": round(props.total_memory / 2**30, 1) if props is not None else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "flash_attn": flash,
        "python": platform.python_version(),
        "machine": machine_info(),
    }


def slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (the file name's device part)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


_NUMBER = re.compile(r"^[<>=≤≥~ ]*(-?[0-9][0-9,]*\.?[0-9]*(?:e[+-]?[0-9]+)?)\s*(%|x|×|s|ms)?$")


def number(cell) -> float | None:
    """A cell's value when it reads as one number ('1.2e-03', '12,345', '41.0%'), else None."""
    if isinstance(cell, (int, float)) and not isinstance(cell, bool):
        return float(cell)
    match = _NUMBER.match(str(cell).strip())
    if match is None:
        return None
    value = float(match.group(1).replace(",", ""))
    return value / 100 if match.group(2) == "%" else value


class ResultFiles:
    """The JSON record of one run and its Markdown rendering, rewritten after every row."""

    def __init__(self, directory: str, mode: str, env: dict, command: str, budget_s: float | None):
        self.started = datetime.datetime.now(datetime.timezone.utc)
        name = "cpu" if mode == "cpu" else slug(env["device"])
        stem = f"{self.started:%Y-%m-%d}-{name}"
        os.makedirs(directory, exist_ok=True)
        self.json_path = os.path.join(directory, stem + ".json")
        self.md_path = os.path.join(directory, stem + ".md")
        self.record: dict = {
            "schema": SCHEMA,
            "tool": "tools/gpu_check.py",
            "command": command,
            "started": self.started.isoformat(timespec="seconds"),
            "updated": None,
            "state": "running",
            "mode": mode,
            "time_budget_s": budget_s,
            "environment": env,
            "sections": [],
            "rows": [],
            "summary": {"PASS": 0, "FAIL": 0, "SKIP": 0},
            "skipped_for_time": [],
        }
        self.scope = ""

    @classmethod
    def from_file(cls, json_path: str) -> ResultFiles:
        """A written record, to render its Markdown again (--docs-from)."""
        with open(json_path) as f:
            record = json.load(f)
        if record.get("schema") != SCHEMA or "rows" not in record:
            raise ValueError(f"{json_path}: not a GPU-check result file of schema {SCHEMA}")
        files = cls.__new__(cls)
        files.record, files.json_path = record, json_path
        files.md_path = json_path[: -len(".json")] + ".md"
        files.scope = ""
        return files

    def begin_section(self, section) -> dict:
        entry = {
            "key": section.key,
            "title": section.title,
            "header": self.header_of(section),
            "note": section.note,
            "estimate_s": section.estimate_s,
            "cap_s": section.cap_s,
            "seconds": None,
            "outcome": "running",
        }
        self.record["sections"].append(entry)
        return entry

    @staticmethod
    def header_of(section) -> list:
        """The printed header: a backend column before status/note in attention tables."""
        header = list(section.header)
        if section.backend_column:
            header[-2:-2] = ["kernel that ran"]
        return header

    def add_row(self, row: dict) -> None:
        env = self.record["environment"]
        for key in ("device", "capability", "torch", "cuda", "cudnn"):
            row[key] = env[key]
        self.record["rows"].append(row)
        verdict = row["verdict"]
        if verdict in self.record["summary"]:
            self.record["summary"][verdict] += 1
        if row["skipped_for_time"]:
            self.record["skipped_for_time"].append(f"{row['section']}: {row['case']}")

    def write(self, state: str | None = None) -> None:
        if state is not None:
            self.record["state"] = state
        self.record["updated"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        )
        _replace(self.json_path, json.dumps(self.record, indent=1, ensure_ascii=False) + "\n")
        _replace(self.md_path, self.markdown(heading="#") + "\n")

    def summary_line(self) -> str:
        c = self.record["summary"]
        return f"{c['PASS']} PASS, {c['FAIL']} FAIL, {c['SKIP']} SKIP."

    def markdown(self, heading: str = "#") -> str:
        r, env = self.record, self.record["environment"]
        where = (
            f"{env['device']} (compute capability {env['capability']}, {env['memory_gib']} GiB)"
            if r["mode"] == "gpu"
            else "CPU, reduced mode (tiny shapes, the GPU check's code paths; its numbers say "
            "nothing about GPUs)"
        )
        versions = (
            f"torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, "
            f"flash-attn {env['flash_attn'] or 'not installed'}; {env['machine']}"
        )
        parts = [
            f"{heading} GPU check: {where}",
            f"Run {r['started']} (updated {r['updated']}); {versions}.",
            f"Command: `{r['command']}`; "
            + (
                f"time budget {r['time_budget_s']:.0f} s. "
                if r["time_budget_s"] is not None
                else "no time budget. "
            )
            + f"Machine-readable: `{os.path.basename(self.json_path)}`.",
        ]
        if self.scope:
            parts.append(self.scope)
        for section in r["sections"]:
            parts.append(self._table(section, heading + "##"))
        state = r["state"]
        parts.append(
            self.summary_line()
            if state == "complete"
            else f"**Incomplete ({state}): the run stopped or is still running after the "
            f"tables above.** {self.summary_line()}"
        )
        skipped = r["skipped_for_time"]
        parts.append(
            "Skipped for time: " + "; ".join(skipped) + "."
            if skipped
            else "Nothing was skipped for time."
        )
        return "\n\n".join(parts)

    def _table(self, section: dict, heading: str) -> str:
        header = section["header"]
        lines = [
            f"{heading} {section['title']}",
            "",
            table_row(header),
            "|" + "|".join("---" for _ in header) + "|",
        ]
        lines += [
            table_row(row["cells"])
            for row in self.record["rows"]
            if row["section"] == section["key"]
        ]
        tail = section["note"] + " " if section["note"] else ""
        if section["seconds"] is not None:
            tail += f"Section time: {section['seconds']:.1f} s."
        return "\n".join(lines) + ("\n\n" + tail.strip() if tail.strip() else "")


def table_row(cells: list) -> str:
    return "| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |"


def _replace(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
