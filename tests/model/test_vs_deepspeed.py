"""Our Ulysses layer and DeepSpeed's DistributedAttention around the same local attention give
bit-equal outputs and input gradients (MHA), and bit-equal outputs with GQA 12 q / 6 kv heads at
SP 4 while sending fewer bytes. Skipped without deepspeed (a benchmark-only dependency:
tools/bench/bench_vs_deepspeed.py says how to install it)."""

import pytest

pytest.importorskip("deepspeed")

from tools.bench.bench_vs_deepspeed import compare_all  # noqa: E402

from tests.distributed import run_distributed  # noqa: E402


def test_mha_outputs_and_gradients_are_bit_equal_to_deepspeed():
    results = run_distributed(compare_all, 2, [(64, 4, 4, "bf16"), (64, 4, 4, "fp32")], 0)
    assert all(case[0] and case[1] for rank in results for case in rank)


def test_gqa_below_sp_sends_no_more_than_deepspeed():
    results = run_distributed(compare_all, 4, [(64, 12, 6, "bf16")], 0)
    assert all(case[0] for rank in results for case in rank)  # outputs bit-equal
    assert max(case[4] for rank in results for case in rank) <= max(
        case[5] for rank in results for case in rank
    )  # bytes, max rank
