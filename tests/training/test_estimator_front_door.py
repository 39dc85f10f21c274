"""The estimator's front doors agree: `python -m tools.memory_estimator` and `--dry-run` print
the same figures for the same training flags (precision, ZeRO, ring, offload, documents,
tiles), and the fewest GPUs the planner finds is a launch `--dry-run` accepts."""

import re

import pytest

from megatron_ul.training.pretrain import main as pretrain_main
from tools.memory_estimator import main as planner_main

BASE = [
    "--mock-data",
    "--vocab-size",
    "1000",
    "--num-layers",
    "2",
    "--hidden-size",
    "512",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "32768",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "2",
    "--world-size",
    "4",
    "--ds-sequence-parallel-size",
    "2",
]
MATRIX = {
    "fp32": [],
    "bf16": ["--bf16"],
    "fp16 zero-1": ["--fp16", "--zero-stage", "1"],
    "bf16 zero-2": ["--bf16", "--zero-stage", "2"],
    "bf16 zero-3 full recompute": [
        "--bf16",
        "--zero-stage",
        "3",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
    ],
    "ring": [
        "--bf16",
        "--context-parallel-size",
        "2",
        "--world-size",
        "8",
        "--attention-dropout",
        "0",
    ],
    "optimizer offload": ["--bf16", "--optimizer-cpu-offload"],
    "documents": ["--reset-attention-mask", "--reset-position-ids"],
    "tiles": [
        "--bf16",
        "--tiled-loss-chunk-size",
        "2048",
        "--tiled-mlp-chunk-size",
        "4096",
        "--attention-block-tiles",
        "2",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--activation-checkpoint-cpu-offload",
    ],
}


def figures(text: str) -> dict[str, float]:
    """name -> GiB of every estimate row, from the planner's table or the dry run's line."""
    rows = re.findall(r"^\| ([^|]+?) \| ([0-9.]+) \|$", text, re.M)
    if not rows:
        line = next(x for x in text.splitlines() if x.startswith("memory estimate per GPU: "))
        rows = re.findall(r"([^|]+?) ([0-9.]+) GiB", line.split(": ", 1)[1])
    return {name.strip(): float(value) for name, value in rows}


def total(text: str) -> float:
    return next(v for k, v in figures(text).items() if k.startswith("total (peak"))


def run(entry, argv, capsys) -> tuple[int, str, str]:
    code = entry(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", list(MATRIX))
def test_planner_and_dry_run_print_the_same_estimate(case, capsys):
    argv = BASE + MATRIX[case]
    code, planned, err = run(planner_main, argv, capsys)
    assert code == 0, err
    code, dry, err = run(pretrain_main, argv + ["--dry-run"], capsys)
    assert code == 0, err
    got, want = figures(planned), figures(dry)
    assert len(want) >= 8 and any(k.startswith("total (peak") for k in want)
    assert got == want


def test_the_fewest_gpus_found_are_a_launch_the_dry_run_accepts(capsys):
    """A model that does not fit on 4 GPUs: the planner's answer, launched as it says, passes
    the dry run's own check, with the figure the planner printed; the layout before it does
    not."""
    argv = BASE + ["--bf16", "--seq-length", "131072", "--zero-stage", "1"]
    code, dry, err = run(pretrain_main, argv + ["--dry-run"], capsys)
    assert code == 0, err
    gpu_gb = f"{total(dry) / 2 + 2:.3f}"  # the 4-GPU plan is twice too large for it
    code, out, err = run(planner_main, argv + ["--gpu-memory-gb", gpu_gb], capsys)
    assert code == 0, err
    assert "this layout does not fit" in out
    fit = re.search(r"smallest fit in .*: (\d+) GPUs .*\(([0-9.]+) GiB per GPU\): (.*)$", out, re.M)
    assert fit is not None, out
    world, fit_total, flags = int(fit[1]), float(fit[2]), fit[3].split()
    assert world > 4
    launch = argv + flags + ["--dry-run", "--gpu-memory-gb", gpu_gb]
    code, dry, err = run(pretrain_main, launch, capsys)
    assert code == 0, err
    assert total(dry) == fit_total
    # the dry run refuses the original layout and names the same answer
    code, _, err = run(pretrain_main, argv + ["--dry-run", "--gpu-memory-gb", gpu_gb], capsys)
    assert code == 1 and f"{world} GPUs would fit ({' '.join(flags)})" in err
