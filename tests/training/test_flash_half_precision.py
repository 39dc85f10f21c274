"""The flagship GPU configuration, run on CPU through the strict flash_attn stand-in: TP2 x SP2,
GQA, RoPE, --use-flash-attn under --bf16 and --fp16. The flash path must run (and take its
fp16/bf16-only, equal-dtype inputs), reproduce the SDPA path within half-precision tolerance,
and keep the Ulysses all-to-all in the activation dtype: half the bytes of fp32."""

import functools

import pytest

from megatron_ul.mpu.comm_stats import count_communication
from megatron_ul.training.pretrain import configure, setup
from tests.distributed import run_distributed
from tests.training.equivalence import BASE, LLAMA_GQA

TP2_SP2 = [
    "--tensor-model-parallel-size",
    "2",
    "--ds-sequence-parallel-size",
    "2",
    "--train-iters",
    "3",
]
RUNS = {  # name -> extra flags
    "fp32-sdpa": [],
    "bf16-sdpa": ["--bf16"],
    "bf16-flash": ["--bf16", "--use-flash-attn"],
    "fp16-sdpa": ["--fp16", "--initial-loss-scale", "4096"],
    "fp16-flash": ["--fp16", "--initial-loss-scale", "4096", "--use-flash-attn"],
    # mock data carries EOD-separated documents: loss masking and position resets keep the
    # flash path; document masking runs per document through flash_attn_varlen_func
    "fp32-sdpa-eod": ["--eod-mask-loss", "--reset-position-ids"],
    "bf16-flash-eod": ["--bf16", "--use-flash-attn", "--eod-mask-loss", "--reset-position-ids"],
    "bf16-flash-documents": [
        "--bf16",
        "--use-flash-attn",
        "--eod-mask-loss",
        "--reset-position-ids",
        "--reset-attention-mask",
    ],
}


def train_each(rank, world, runs: dict):
    """Train every run on the same 4 ranks (one spawn); per run: losses, bytes sent by this
    rank's Ulysses all-to-alls, flash_attn calls."""
    import flash_attn  # the stand-in (the test's fixture put it on sys.path)

    results = {}
    for name, argv in runs.items():
        before = sum(flash_attn.calls.values())
        trainer = setup(configure(argv, world))
        with count_communication() as counts:
            losses = trainer.train()
        results[name] = {
            "losses": losses,
            "all_to_all_bytes": counts["all_to_all"]["bytes"],
            "flash_calls": sum(flash_attn.calls.values()) - before,
        }
    return results


@functools.cache
def _results(flash: bool, release: str):
    """Per rank, the runs with (or without) --use-flash-attn; the SDPA runs do not depend on
    the flash-attn release, so they run once."""
    runs = {
        name: BASE + LLAMA_GQA + TP2_SP2 + flags
        for name, flags in RUNS.items()
        if ("flash" in name) == flash
    }
    return run_distributed(train_each, 4, runs, timeout=600)


pytestmark = pytest.mark.slow  # 8 TP2×SP2 runs; the flash stand-in alone: test_flash_attn_stand_in


@pytest.fixture
def results(flash_attn_stand_in):
    """Every run; the flash runs under each flash-attn release's stand-in (the fixture's)."""
    sdpa = _results(False, "")
    flash = _results(True, flash_attn_stand_in.__version__)
    return [{**a, **b} for a, b in zip(sdpa, flash)]


def test_flash_path_runs_and_matches_sdpa_in_bf16_and_fp16(results):
    for rank_results in results:
        for name, r in rank_results.items():
            assert (r["flash_calls"] > 0) == ("flash" in name), name
    r = results[0]
    for precision in ("bf16", "fp16"):
        flash, sdpa = r[f"{precision}-flash"]["losses"], r[f"{precision}-sdpa"]["losses"]
        diff = max(abs(a - b) for a, b in zip(flash, sdpa))
        print(f"{precision}: flash vs SDPA max loss diff {diff:.2e}")
        assert diff < 2e-2, (precision, flash, sdpa)
        # and both track fp32 (the half-precision tolerance of tests/optim/test_precision.py)
        fp32 = r["fp32-sdpa"]["losses"]
        assert max(abs(a - b) for a, b in zip(flash, fp32)) < 2e-2
        assert flash != fp32  # it really ran in half precision


def test_ulysses_all_to_all_moves_half_the_bytes_in_bf16(results):
    for rank_results in results:
        fp32 = rank_results["fp32-sdpa"]["all_to_all_bytes"]
        assert fp32 > 0
        for name in ("bf16-sdpa", "bf16-flash", "fp16-sdpa", "fp16-flash"):
            assert rank_results[name]["all_to_all_bytes"] == fp32 / 2, name


def test_eod_documents_on_mock_data_with_the_flash_path(results):
    r = results[0]
    flash, fp32 = r["bf16-flash-eod"]["losses"], r["fp32-sdpa-eod"]["losses"]
    assert max(abs(a - b) for a, b in zip(flash, fp32)) < 2e-2
    assert fp32 != r["fp32-sdpa"]["losses"]  # the EOD flags changed the problem
    masked = r["bf16-flash-documents"]["losses"]  # per document, flash_attn_varlen_func
    assert masked != flash and max(abs(a - b) for a, b in zip(masked, flash)) < 0.5
