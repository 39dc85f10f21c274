"""Bad MoE combinations are refused by the entry point before any model is built, naming the
flags (exit status 2)."""

import pytest

from tests.refusals import refusal

OK = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "64"]
OK += ["--num-attention-heads", "4", "--seq-length", "32", "--disable-bias-linear"]

CASES = [
    (["--num-experts", "4", "--moe-router-topk", "5"], ["--moe-router-topk 5", "--num-experts 4"]),
    (
        [
            "--num-experts",
            "6",
            "--expert-model-parallel-size",
            "4",
            "--dry-run",
            "--world-size",
            "8",
        ],
        ["--num-experts 6", "--expert-model-parallel-size 4"],
    ),
    (
        [
            "--num-experts",
            "4",
            "--expert-model-parallel-size",
            "4",
            "--dry-run",
            "--world-size",
            "2",
        ],
        ["--expert-model-parallel-size 4", "DP × CP × SP = 2"],
    ),
    (
        ["--num-experts", "4", "--moe-expert-capacity-factor", "-1"],
        ["--moe-expert-capacity-factor"],
    ),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "0"], ["--moe-expert-capacity-factor"]),
    (["--num-experts", "0"], ["--num-experts"]),
    (["--expert-model-parallel-size", "2", "--dry-run", "--world-size", "2"], ["--num-experts"]),
    (
        ["--num-experts", "4", "--expert-tensor-parallel-size", "2"],
        ["--expert-tensor-parallel-size 2"],
    ),
    (
        ["--num-experts", "4", "--moe-pad-expert-input-to-capacity"],
        ["--moe-expert-capacity-factor"],
    ),
]


@pytest.mark.parametrize("flags,named", CASES)
def test_bad_moe_combination_refused_naming_the_flags(flags, named, capsys, monkeypatch):
    err = refusal(OK + flags, capsys, monkeypatch)
    for text in named:
        assert text in err, (text, err)


def test_moe_with_biases_refused(capsys, monkeypatch):
    argv = [a for a in OK if a != "--disable-bias-linear"] + ["--num-experts", "4"]
    assert "--disable-bias-linear" in refusal(argv, capsys, monkeypatch)


def test_grouped_gemm_unavailable_refused(capsys, monkeypatch):
    import torch

    monkeypatch.delattr(torch, "_grouped_mm")
    err = refusal(OK + ["--num-experts", "4", "--moe-grouped-gemm"], capsys, monkeypatch)
    assert "--moe-grouped-gemm" in err
