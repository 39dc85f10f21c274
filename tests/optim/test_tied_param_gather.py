"""ZeRO-1 --overlap-param-gather with tied embeddings under pipelining: the last stage reads the
embedding table in its output layer, where the embedding's forward (whose hook waits for the
table's all-gather) never runs; the read itself waits for the gather.

Checked under a stand-in whose asynchronous all-gathers write their output only when waited on
(tests/stand_ins/delayed_all_gather.py, NCCL's stream semantics): the run matches the
one-process run within 1e-5 (fp32), and the same run without the wait before that read (the
old order) reads the previous step's table and does not."""

from __future__ import annotations

from megatron_ul.model.gpt import GPTModel
from tests.distributed import run_distributed
from tests.stand_ins.delayed_all_gather import delayed_all_gathers
from tests.training.equivalence import (
    BASE,
    GPT2_STYLE,
    compare,
    merge_tp_shards,
    one_process_reference,
    train_and_collect,
)

# PP 2 × DP 2: ZeRO-1 shards every bucket over two ranks, so the last stage's copy of the table
# is half this rank's update and half the other rank's gathered values.
ZERO1_PP2 = [
    "--pipeline-model-parallel-size",
    "2",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
]


def _train_with_delayed_gathers(rank: int, world: int, argv: list[str], wait_for_tied: bool):
    if not wait_for_tied:  # the old order: nothing waits before the output layer's read
        GPTModel.register_tied_weight_read_hook = lambda self, hook: None  # type: ignore[method-assign]
    with delayed_all_gathers():
        return train_and_collect(rank, world, argv)


def _run(wait_for_tied: bool):
    results = run_distributed(
        _train_with_delayed_gathers, 4, BASE + GPT2_STYLE + ZERO1_PP2, wait_for_tied
    )
    for r in results:  # every rank reports the same losses
        assert r["losses"] == results[0]["losses"]
    return results[0]["losses"], merge_tp_shards(results)


def test_the_tied_table_is_read_after_its_all_gather():
    reference = one_process_reference(GPT2_STYLE)
    loss_diff, param_diff = compare(reference, _run(wait_for_tied=True), 4, 4)
    stale_loss_diff, stale_param_diff = compare(reference, _run(wait_for_tied=False), 4, 4)
    print(
        f"waiting before the read: loss diff {loss_diff:.2e}, param diff {param_diff:.2e}; "
        f"old order: loss diff {stale_loss_diff:.2e}, param diff {stale_param_diff:.2e}"
    )
    assert loss_diff < 1e-5 and param_diff < 1e-5
    assert stale_loss_diff > 1e-4  # the stand-in shows the race the wait removes
