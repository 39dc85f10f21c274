"""Our Ulysses layer, DeepSpeed's DistributedAttention and ALST's UlyssesSPAttentionHF around the
same local attention give bit-equal outputs and input gradients (MHA), ours writing no more
bytes in its ops than either (the same layout copies as DeepSpeed's), and bit-equal outputs
with GQA 12 q / 6 kv heads at SP 4 (which ALST refuses) while sending no more bytes. Skipped
without deepspeed (a benchmark-only dependency: tools/bench/bench_vs_deepspeed.py says how to
install it), and with a DeepSpeed whose DistributedAttention takes no num_kv_heads (the release
the block-sparse layout tests pin, 0.18.9, is one)."""

import inspect

import pytest

pytest.importorskip("einops")
_sequence = pytest.importorskip("deepspeed.sequence.layer")
if "num_kv_heads" not in inspect.signature(_sequence.DistributedAttention.__init__).parameters:
    pytest.skip("DeepSpeed's DistributedAttention takes no num_kv_heads", allow_module_level=True)

from tests.distributed import run_distributed  # noqa: E402
from tools.bench.bench_vs_deepspeed import compare_all  # noqa: E402


@pytest.mark.parametrize("attention", ["sdpa", "sum"])
def test_mha_outputs_and_gradients_are_bit_equal_to_deepspeed_and_alst(attention):
    cases = [(64, 4, 4, "bf16", attention), (64, 4, 4, "fp32", attention)]
    results = run_distributed(compare_all, 2, cases, 0)
    for rank in results:
        for case in rank:
            for name in ("DeepSpeed", "ALST"):
                same_out, same_grads, _, _, sent, written = case[name]
                assert same_out and same_grads, name
                assert case["ours"][4] <= sent, name  # bytes on the wire
                assert case["ours"][5] <= written, name  # bytes the ops write


def test_gqa_below_sp_sends_no_more_than_deepspeed():
    results = run_distributed(compare_all, 4, [(64, 12, 6, "bf16", "sdpa")], 0)
    for rank in results:
        (case,) = rank
        assert case["ALST"] is None  # 6 kv heads over SP 4: ALST refuses
        assert case["DeepSpeed"][0]  # outputs bit-equal
    assert max(r[0]["ours"][4] for r in results) <= max(r[0]["DeepSpeed"][4] for r in results)
