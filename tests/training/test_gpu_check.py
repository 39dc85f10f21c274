"""tools/gpu_check.py: its reduced CPU mode runs every section of the GPU check (with the strict
flash_attn stand-in in place of the real kernel, so the flash-attn row runs too), and the
section runner keeps what it measured when a section fails or the process dies."""

import os
import subprocess
import sys
import textwrap

import pytest

from megatron_ul.model.attention import FLASH_ON_CPU_ENV
from tests.conftest import ROOT, STAND_INS
from tools import gpu_check

SECTIONS = [
    "Training steps against fp32",
    "Attention paths on the device",
    "Ring attention: R virtual ranks",
    "Activation offload",
    "Optimizer offload",
    "torch_dist --async-save",
    "Fused AdamW",
    "--fused-layers",
    "Documents and windows",
    "Speed and memory",
]


def _run(args, env_extra=None, timeout=600):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([STAND_INS, ROOT]),
        **{FLASH_ON_CPU_ENV: "1"},
        OMP_NUM_THREADS="1",
        **(env_extra or {}),
    )
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _rows(text: str, label: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"| {label}")]


def test_gpu_check_cpu_mode_passes_and_reports():
    out = _run(["-m", "tools.gpu_check", "--cpu"])
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert gpu_check.SCOPE in text
    positions = [text.index(f"### {title}") for title in SECTIONS]
    assert positions == sorted(positions)
    for check in (
        "bf16, torch SDPA flash kernel vs fp32",
        "bf16, flash-attn 2 vs fp32",
        "fp16 + dynamic loss scaling vs fp32",
        "fp16 overflow",
        "causal, GQA, fp32",
        "4 documents + window 2",
        "R=4, causal, GQA, bf16",
        "R=2, causal, GQA, fp32",
        "+ --activation-checkpoint-cpu-offload",
        "bf16, losses",
        "async save at step 2",
        "resumed steps 3-4",
        "fused AdamW vs foreach",
        "--fused-layers vs eager layers",
        "20 documents + window 16",
    ):
        rows = _rows(text, check)
        assert rows and all("| PASS |" in row for row in rows), (check, rows)
    assert "flash_attn_func calls" in text and "| FAIL |" not in text
    # the ring reaches its fixpoint; the speed table has the fixed lengths and the longest search
    assert "| R=4, window 2, bf16 |" in text and "4 passes" in text
    assert "| 32 | none |" in text and "| 64 | none |" in text and "| 128 | full |" in text
    assert "0 FAIL" in text.splitlines()[-1]


DRIVER = textwrap.dedent("""
    import itertools, os, sys
    from tools import gpu_check as g, gpu_check_runner as runner
    runner.BENCHMARKS_DOC, runner.GPU_DOC = sys.argv[1], sys.argv[2]

    ring_rows = g.ring_rows

    def broken_ring(check):
        yield from itertools.islice(ring_rows(check), 1)
        raise ValueError("injected failure")

    def dying(check):
        os._exit(3)   # no flush, no atexit: only what was flushed survives
        yield

    g.ring_rows, g.adamw_rows = broken_ring, dying
    check = g.Check(g.CPU, write_docs=True)
    for section in g.sections(g.CPU):
        if section.key in ("attention", "ring", "adamw"):
            check.run(section)
""")


def test_a_failing_section_keeps_the_other_tables_and_a_crash_keeps_what_was_flushed(tmp_path):
    bench, gpu = tmp_path / "benchmarks.md", tmp_path / "gpu.md"
    out = _run(["-c", DRIVER, str(bench), str(gpu)])
    assert out.returncode == 3, out.stdout + out.stderr
    text = out.stdout
    # the attention table was complete before the ring section failed
    assert all("| PASS |" in row for row in _rows(text, "causal, "))
    assert len(_rows(text, "causal, ")) == 3
    ring_pass = _rows(text, "R=2, causal, GQA, bf16")
    failed = _rows(text, "ring: section aborted")
    assert ring_pass and "| PASS |" in ring_pass[0]
    assert failed and "| FAIL |" in failed[0] and "ValueError: injected failure" in failed[0]
    assert "### Fused AdamW" in text  # the next section started after the failure
    for doc in (bench, gpu):  # the docs were rewritten after each section
        written = doc.read_text()
        assert "| causal, GQA, fp32 |" in written and "ValueError: injected failure" in written
        assert "Incomplete" in written and "<!-- gpu-check:end -->" in written


def test_exit_status_counts_fail_rows_and_unknown_sections_are_refused(monkeypatch, capsys):
    assert gpu_check.main(["--cpu", "--sections", "adamw"]) == 0

    def failing(check):
        yield ["injected", "", "", "FAIL", "a bound was missed"]

    monkeypatch.setattr(gpu_check, "adamw_rows", failing)
    assert gpu_check.main(["--cpu", "--sections", "adamw"]) == 1
    assert "0 PASS, 1 FAIL, 0 SKIP." in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gpu_check.main(["--cpu", "--sections", "no-such-section"])
    with pytest.raises(SystemExit):
        gpu_check.main(["--cpu", "--write-docs"])


def test_the_time_budget_skips_what_no_longer_fits(capsys):
    check = gpu_check.Check(gpu_check.CPU, write_docs=False)
    check.enforce_budget, check.deadline = True, 0.0
    adamw = next(s for s in gpu_check.sections(gpu_check.CPU) if s.key == "adamw")
    check.run(adamw)
    assert check.counts == {"PASS": 0, "FAIL": 0, "SKIP": 1}
    row = _rows(capsys.readouterr().out, "adamw")[0]
    assert "| SKIP | time budget:" in row
