"""tools/gpu_check.py: its reduced CPU mode runs every section of the GPU check (with the strict
flash_attn and efficient-kernel stand-ins in place of the CUDA kernels), in the most informative
order, into a machine-readable result file; every section is isolated (an exception, a failing
release or a lost CUDA context fails its own rows and the run goes on); a crash keeps what was
written; what the time budget no longer allows is skipped and reported."""

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from megatron_ul.model.attention import lse_kernels
from megatron_ul.model.attention.dispatch import sdpa_backend_name
from megatron_ul.model.attention.flash_attn import FLASH_ON_CPU_ENV
from tests.conftest import ROOT, STAND_INS
from tools import gpu_check, gpu_check_runner
from tools.gpu_check_results import ResultFiles, environment
from tools.gpu_check_sdpa import TORCH_2_11_SDP_VALUES, SdpaRecorder, backend_names

ORDER = [
    "efficient",
    "dropout",
    "documents",
    "performance",
    "precision",
    "zero3",
    "attention",
    "ring",
    "offload",
    "optimizer-offload",
    "checkpoint",
    "adamw",
    "fused",
]
ROW_KEYS = {
    "section",
    "case",
    "verdict",
    "note",
    "bound",
    "values",
    "measured",
    "sdpa_backend",
    "sdpa_calls",
    "skipped_for_time",
    "cells",
    "at_s",
    "seconds",
    "device",
    "capability",
    "torch",
    "cuda",
    "cudnn",
}


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


def _record(directory) -> dict:
    (path,) = [p for p in os.listdir(directory) if p.endswith(".json")]
    assert os.path.exists(os.path.join(directory, path[: -len(".json")] + ".md"))
    with open(os.path.join(directory, path)) as f:
        return json.load(f)


def test_sections_run_most_informative_first_and_the_cold_compile_last():
    assert [s.key for s in gpu_check.sections(gpu_check.CPU)] == ORDER
    assert [s.key for s in gpu_check.sections(gpu_check.GPU)] == ORDER
    # the estimates fit the 8 minutes with room for start-up and the last writes
    assert sum(s.estimate_s for s in gpu_check.sections(gpu_check.GPU)) < gpu_check.GPU.budget_s
    assert gpu_check.GPU.budget_s <= 8 * 60 - 20
    assert all(s.estimate_s <= s.cap_s for s in gpu_check.sections(gpu_check.GPU))


def test_gpu_check_cpu_mode_passes_and_writes_its_result_files(tmp_path):
    out = _run(["-m", "tools.gpu_check", "--cpu", "--results-dir", str(tmp_path)])
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert gpu_check.SCOPE in text
    titles = [s.title for s in gpu_check.sections(gpu_check.CPU)]
    positions = [text.index(f"### {title}") for title in titles]
    assert positions == sorted(positions)
    for check in (
        "ring unit, causal, 4/2 heads, bf16",
        "ring unit, masked, 4/2 heads, fp16",
        "document tiles, 4 documents + window",
        "document tiles, 4 documents + window 16, dropout 0.1, bf16",
        "causal, dropout 0.1, bf16",
        "4 documents + window 16, dropout 0.1, bf16",
        "20 documents, --attention-dropout 0.1",
        "bf16 vs fp32 (SDPA's own choice)",
        "bf16, torch SDPA flash kernel vs fp32",
        "bf16, flash-attn 2 vs fp32",
        "fp16 + dynamic loss scaling vs fp32",
        "fp16 overflow",
        "ZeRO-3 on one rank vs plain AdamW, fp32",
        "ZeRO-3 on one rank vs plain AdamW, bf16",
        "causal, GQA, fp32",
        "4 documents + window 2",
        "R=4, causal, GQA, bf16",
        "R=2, causal, GQA, fp32",
        "+ --activation-checkpoint-cpu-offload",
        "bf16, losses",
        "async save at step 2",
        "resumed steps 3-4",
        "fused AdamW vs foreach",
        "--fused-layers vs eager layers, bf16",
        "--fused-layers vs eager layers, fp32",
        "20 documents + window 16",
    ):
        rows = _rows(text, check)
        assert rows and all("| PASS |" in row for row in rows), (check, rows)
    assert "flash_attn_func calls" in text and "| FAIL |" not in text
    assert "| R=4, window 2, bf16 |" in text and "4 passes" in text
    assert "| 32 | none |" in text and "| 64 | none |" in text and "| 128 | full |" in text
    assert "Nothing skipped for time." in text

    record = _record(tmp_path)
    assert record["schema"] == 1 and record["state"] == "complete" and record["mode"] == "cpu"
    assert set(record["environment"]) >= {"device", "capability", "torch", "cuda", "cudnn"}
    assert record["environment"]["torch"] == torch.__version__
    assert [s["key"] for s in record["sections"]] == ORDER
    assert all(s["outcome"] == "ran" and s["seconds"] is not None for s in record["sections"])
    rows = record["rows"]
    assert record["summary"] == {v: sum(r["verdict"] == v for r in rows) for v in record["summary"]}
    assert record["summary"]["FAIL"] == 0 and record["skipped_for_time"] == []
    for row in rows:
        assert set(row) == ROW_KEYS, row
        assert row["verdict"] in ("PASS", "FAIL", "SKIP")
        assert row["torch"] == torch.__version__ and row["device"] == "cpu"
        assert row["cells"][0] == row["case"] and row["cells"][-2] == row["verdict"]
    # every attention row that ran names the kernel that ran, counted on its own calls
    with_kernel = {s.key for s in gpu_check.sections(gpu_check.CPU) if s.backend_column}
    assert {"efficient", "dropout", "documents", "attention", "ring"} <= with_kernel
    ran = [r for r in rows if r["section"] in with_kernel and r["verdict"] == "PASS"]
    assert ran and all(r["sdpa_backend"] and sum(r["sdpa_calls"].values()) > 0 for r in ran)
    by_case = {r["case"]: r for r in rows}
    assert by_case["ring unit, causal, 4/2 heads, bf16"]["sdpa_backend"].startswith("efficient")
    assert by_case["causal, GQA, fp32"]["sdpa_backend"] == "sdpa flash (cpu)"
    # measured values are numbers, bounds are recorded
    unit = by_case["ring unit, causal, 4/2 heads, bf16"]
    assert 0 < unit["measured"]["grad error"] < 5e-2 and unit["bound"] == "0.02 / 0.05"
    dropout = by_case["causal, dropout 0.1, bf16"]
    assert abs(dropout["measured"]["dropped"] - 0.1) < 0.05
    md = open(
        os.path.join(tmp_path, "2000-01-01-cpu.md".replace("2000-01-01", record["started"][:10]))
    ).read()
    assert "| path | out error | grad error |" in md and "| kernel that ran |" in md
    assert "| ring unit, causal, 4/2 heads, bf16 |" in md and "0 FAIL" in md


def _fake_section(key, rows, cap=60.0):
    return gpu_check_runner.Section(
        key, f"Fake {key}", ["case", "bound", "status", "note"], rows, 0, cap
    )


def _check(tmp_path, mode=gpu_check.CPU, budget=None):
    results = ResultFiles(str(tmp_path), "cpu", environment("cpu"), "test", 240)
    return gpu_check_runner.Check(mode, results=results, time_budget_s=budget), results


def test_a_raising_section_and_a_failing_release_fail_their_own_rows_and_the_rest_runs(
    tmp_path, monkeypatch, capsys
):
    def raising(check):
        yield ["measured first", "-", "PASS", ""]
        raise ValueError("injected failure")

    releases = []

    def failing_release():  # a torch.cuda.synchronize that raises, once
        releases.append(1)
        if len(releases) == 2:
            raise RuntimeError("CUDA error: injected synchronize failure")

    monkeypatch.setattr(gpu_check_runner, "release", failing_release)
    check, results = _check(tmp_path)
    adamw = next(s for s in gpu_check.sections(gpu_check.CPU) if s.key == "adamw")
    for section in (
        _fake_section("raising", raising),
        _fake_section("released", lambda check: iter([["fine", "-", "PASS", ""]])),
        adamw,
    ):
        check.run(section)
    rows = [(r["section"], r["case"], r["verdict"], r["note"]) for r in results.record["rows"]]
    assert rows[0] == ("raising", "measured first", "PASS", "")
    assert rows[1][:3] == ("raising", "raising: section aborted", "FAIL")
    assert "ValueError: injected failure" in rows[1][3]
    assert rows[2] == ("released", "fine", "PASS", "")
    assert rows[3][:3] == ("released", "released: release after the section", "FAIL")
    assert "injected synchronize failure" in rows[3][3]
    assert rows[4][0] == "adamw" and rows[4][2] == "PASS"  # the next section ran
    assert check.counts == {"PASS": 3, "FAIL": 2, "SKIP": 0}
    # the files on disk already hold every row (written after each one)
    on_disk = _record(tmp_path)
    assert len(on_disk["rows"]) == 5 and on_disk["state"] == "running"
    assert [s["outcome"] for s in on_disk["sections"]] == ["aborted", "aborted", "ran"]
    text = open(results.md_path).read()
    assert "| raising: section aborted |" in text and "Incomplete (running)" in text
    check.finish()
    assert _record(tmp_path)["state"] == "complete"


def test_after_a_sticky_cuda_error_later_sections_are_recorded_not_run(tmp_path):
    """On a GPU a section's exception is followed by a probe of the CUDA context; where the
    probe fails too (here: no CUDA at all), every later section is a SKIP row naming the error
    and its rows are not started."""
    started = []

    def illegal_address(check):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
        yield

    def later(check):
        started.append(1)
        yield ["never", "-", "PASS", ""]

    check, results = _check(tmp_path, mode=replace(gpu_check.CPU, device="cuda"))
    for section in (_fake_section("kernel", illegal_address), _fake_section("later", later)):
        check.run(section)
    assert started == []
    (failed, skipped) = results.record["rows"]
    assert failed["verdict"] == "FAIL" and "illegal memory access" in failed["note"]
    assert skipped["verdict"] == "SKIP" and skipped["section"] == "later"
    assert "CUDA context is unusable since section kernel" in skipped["note"]
    assert results.record["sections"][1]["outcome"] == "not run: CUDA context lost"


def test_the_time_budget_skips_what_no_longer_fits_and_reports_it(tmp_path, capsys):
    def two_cases(check):
        yield ["first case", "-", "PASS", ""]
        check.need(1e6, "the second case")
        yield ["second case", "-", "PASS", ""]

    check, results = _check(tmp_path, budget=1e5)
    check.run(_fake_section("cut", two_cases))
    check.run(_fake_section("late", lambda check: iter([["x", "-", "PASS", ""]])))
    check.budget_s, check.deadline = 0.0, 0.0
    adamw = next(s for s in gpu_check.sections(gpu_check.CPU) if s.key == "adamw")
    check.run(adamw)
    check.finish()
    record = _record(tmp_path)
    cut, late, skipped_section = record["rows"][1], record["rows"][2], record["rows"][3]
    assert cut["verdict"] == "SKIP" and cut["skipped_for_time"]
    assert "the second case needs ~1000000 s" in cut["note"]
    assert late["verdict"] == "PASS"  # the next section had time for its case
    assert skipped_section["section"] == "adamw" and skipped_section["skipped_for_time"]
    assert record["skipped_for_time"] == ["cut: cut", "adamw: adamw"]
    assert [s["outcome"] for s in record["sections"]] == ["cut for time", "ran", "cut for time"]
    assert "Skipped for time: cut: cut; adamw: adamw." in open(results.md_path).read()

    # the command line says it at the end of its output
    code = gpu_check.main(
        ["--cpu", "--sections", "adamw", "--time-budget", "0.001", "--results-dir", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0 and "Skipped for time: adamw: adamw." in out


DRIVER = textwrap.dedent("""
    import itertools, os, sys
    from tools import gpu_check as g, gpu_check_runner as runner
    from tools.gpu_check_results import ResultFiles, environment
    runner.BENCHMARKS_DOC, runner.GPU_DOC = sys.argv[1], sys.argv[2]

    ring_rows = g.ring_rows

    def broken_ring(check):
        yield from itertools.islice(ring_rows(check), 1)
        raise ValueError("injected failure")

    def dying(check):
        os._exit(3)   # no flush, no atexit: only what was written survives
        yield

    g.ring_rows, g.adamw_rows = broken_ring, dying
    results = ResultFiles(sys.argv[3], "cpu", environment("cpu"), "driver", 240)
    check = g.Check(g.CPU, write_docs=True, results=results)
    for section in g.sections(g.CPU):
        if section.key in ("attention", "ring", "adamw"):
            check.run(section)
""")


def _repo_outputs() -> dict:
    """What a run could write in the checkout: the docs' sections and the result files."""
    paths = [os.path.join(ROOT, "docs", name) for name in ("gpu.md", "benchmarks.md")]
    results = os.path.join(ROOT, "docs", "results", "gpu")
    if os.path.isdir(results):
        paths += [os.path.join(results, name) for name in sorted(os.listdir(results))]
    return {path: open(path, "rb").read() for path in paths if os.path.isfile(path)}


def test_a_crash_keeps_every_row_written_before_it(tmp_path):
    bench, gpu, results = tmp_path / "benchmarks.md", tmp_path / "gpu.md", tmp_path / "results"
    before = _repo_outputs()
    out = _run(["-c", DRIVER, str(bench), str(gpu), str(results)])
    assert _repo_outputs() == before  # the checkout's docs and results untouched
    assert out.returncode == 3, out.stdout + out.stderr
    text = out.stdout
    assert len(_rows(text, "causal, ")) == 3
    assert all("| PASS |" in row for row in _rows(text, "causal, "))
    failed = _rows(text, "ring: section aborted")
    assert failed and "| FAIL |" in failed[0] and "ValueError: injected failure" in failed[0]
    assert "### Fused AdamW" in text  # the next section started after the failure
    record = _record(results)
    assert record["state"] == "running"  # never finished
    cases = [r["case"] for r in record["rows"]]
    assert "causal, GQA, fp32" in cases and "ring: section aborted" in cases
    assert [(s["key"], s["outcome"]) for s in record["sections"]] == [
        ("attention", "ran"),
        ("ring", "aborted"),
        ("adamw", "running"),  # the section the crash hit
    ]
    for doc in (bench, gpu):  # the docs' section was rewritten after each section
        written = doc.read_text()
        assert "| causal, GQA, fp32 |" in written and "ValueError: injected failure" in written
        assert "Incomplete" in written and "<!-- gpu-check:end -->" in written


def test_exit_status_counts_fail_rows_and_bad_flags_are_refused(monkeypatch, capsys, tmp_path):
    where = ["--results-dir", str(tmp_path)]
    assert gpu_check.main(["--cpu", "--sections", "adamw", *where]) == 0

    def failing(check):
        yield ["injected", "", "", "FAIL", "a bound was missed"]

    monkeypatch.setattr(gpu_check, "adamw_rows", failing)
    assert gpu_check.main(["--cpu", "--sections", "adamw", *where]) == 1
    assert "0 PASS, 1 FAIL, 0 SKIP." in capsys.readouterr().out
    for bad in (
        ["--sections", "no-such-section"],
        ["--write-docs"],
        ["--time-budget", "0"],
        ["--results-dir", str(tmp_path / "x.json" / "y")],
    ):
        if bad[0] == "--results-dir":
            (tmp_path / "x.json").write_text("a file, not a directory")
        with pytest.raises(SystemExit):
            gpu_check.main(["--cpu", *bad])
        assert bad[0] in capsys.readouterr().err


def test_the_kernel_that_ran_is_sdpas_own_choice_on_the_calls_inputs():
    """The recorder asks aten::_fused_sdp_choice with each SDPA call's own arguments and names
    the answer by torch's SDPBackend enum (torch 2.11's values); direct calls of a fused op
    are counted by the op's name."""
    schema = str(torch.ops.aten._fused_sdp_choice.default._schema)
    for argument in ("Tensor? attn_mask=None", "float dropout_p=0.", "bool is_causal=False"):
        assert argument in schema
    assert "float? scale=None" in schema and "bool enable_gqa=False" in schema
    assert backend_names() == {v: sdpa_backend_name(v) for v in TORCH_2_11_SDP_VALUES}
    q, k = torch.randn(1, 4, 32, 16), torch.randn(1, 2, 32, 16)
    calls = [
        ((q, k, k), {"is_causal": True, "enable_gqa": True}),
        ((q, q, q, None, 0.25, True), {}),
        ((q.double(), q.double(), q.double()), {}),
    ]
    expected = []
    for args, kwargs in calls:
        a = dict(zip(["query", "key", "value", "attn_mask", "dropout_p", "is_causal"], args))
        a.update(kwargs)
        choice = torch.ops.aten._fused_sdp_choice(
            a["query"],
            a["key"],
            a["value"],
            a.get("attn_mask"),
            a.get("dropout_p", 0.0),
            a.get("is_causal", False),
            enable_gqa=a.get("enable_gqa", False),
        )
        expected.append(f"sdpa {sdpa_backend_name(choice)} (cpu)")
    with SdpaRecorder() as recorder:
        for args, kwargs in calls:
            F.scaled_dot_product_attention(*args, **kwargs)
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True)
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.0, True)
    counted = Counter(recorder.calls)
    assert counted.pop("cpu flash (direct)") == 2
    assert counted == Counter(expected)


def _old_efficient_backward(dout, q, k, v, out, lse, causal, bias, scale):
    """The efficient-kernel backward as lse_kernels called it before the layout fix: out and
    dout handed over as contiguous [b, h, s, d], which the kernel reads with a row stride of
    h·d (the heads interleaved), so more than one head gives wrong dq and dk."""
    b, heads, sq, _ = q.shape
    padded = torch.zeros(b, heads, -(-sq // 32) * 32)
    padded[..., :sq] = lse
    no_rng = torch.empty((), dtype=torch.int64)

    def expand(t):
        return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)

    full_bias = None if bias is None else bias.expand(b, heads, *bias.shape[2:])
    dq, dk, dv, _ = lse_kernels.cuda_ops._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(),
        q,
        expand(k),
        expand(v),
        full_bias,
        out.contiguous(),
        padded,
        no_rng,
        no_rng,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    group = heads // k.shape[1]
    if group > 1:
        dk, dv = (t.view(b, k.shape[1], group, *t.shape[2:]).sum(2) for t in (dk, dv))
    return dq, dk, dv


def test_the_efficient_section_fails_the_old_layout_of_out(monkeypatch, tmp_path):
    """Run on the kernel's CPU stand-in (which reads out through the kernel's addressing), the
    first section passes with today's lse_kernels and fails every half-precision row with the
    old call; fp32, whose delta is computed by torch ops, passes either way."""
    efficient = next(s for s in gpu_check.sections(gpu_check.CPU) if s.key == "efficient")
    check, results = _check(tmp_path / "new")
    check.run(efficient)
    new = results.record["rows"]
    assert len(new) == 14 and all(r["verdict"] == "PASS" for r in new)

    old = lse_kernels.UnitKernel(
        "sdpa-efficient", True, lse_kernels.SDPA_EFFICIENT.forward, _old_efficient_backward
    )
    monkeypatch.setattr(lse_kernels, "SDPA_EFFICIENT", old)
    monkeypatch.setitem(lse_kernels.KERNELS, "sdpa-efficient", old)
    check, results = _check(tmp_path / "old")
    check.run(efficient)
    verdicts = {r["case"]: r["verdict"] for r in results.record["rows"]}
    assert len(verdicts) == 14
    for case, verdict in verdicts.items():
        # the dropout tiles call the kernel's backward themselves (with the philox state)
        unaffected = case.endswith("fp32") or "dropout" in case
        assert verdict == ("PASS" if unaffected else "FAIL"), (case, verdict)


def test_docs_are_written_from_a_gpu_result_file_and_never_from_a_cpu_one(
    tmp_path, monkeypatch, capsys
):
    env = dict(environment("cpu"), device="NVIDIA H200", capability="9.0", memory_gib=139.8)
    results = ResultFiles(str(tmp_path), "gpu", env, "python -m tools.gpu_check", 450)
    assert os.path.basename(results.json_path).endswith("-nvidia-h200.json")
    check = gpu_check_runner.Check(gpu_check.CPU, results=results)
    check.run(_fake_section("fake", lambda check: iter([["a case", "< 1", "PASS", "fine"]])))
    check.finish()
    bench, gpu = tmp_path / "benchmarks.md", tmp_path / "gpu.md"
    gpu.write_text("# GPUs\n\n<!-- gpu-check:start -->\nold\n<!-- gpu-check:end -->\n\nrest\n")
    monkeypatch.setattr(gpu_check_runner, "BENCHMARKS_DOC", str(bench))
    monkeypatch.setattr(gpu_check_runner, "GPU_DOC", str(gpu))
    assert gpu_check.main(["--docs-from", results.json_path]) == 0
    text = gpu.read_text()
    assert "old" not in text and text.endswith("rest\n")
    assert "## GPU check: NVIDIA H200 (compute capability 9.0" in text
    assert "| a case | < 1 | PASS | fine |" in text and "1 PASS, 0 FAIL, 0 SKIP." in text
    assert "| a case | < 1 | PASS | fine |" in bench.read_text()

    cpu = ResultFiles(str(tmp_path / "cpu"), "cpu", environment("cpu"), "test", 240)
    cpu.write()
    with pytest.raises(SystemExit):
        gpu_check.main(["--docs-from", cpu.json_path])
    assert "say nothing about GPUs" in capsys.readouterr().err
