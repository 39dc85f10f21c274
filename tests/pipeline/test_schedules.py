"""The pipelined operation orders: every (chunk, micro-batch) runs forward then backward once,
the warm-up matches Megatron, and the interleaved schedule's communication steps are Megatron's
(a steady-state forward and the backward after it share one step). That the orders complete
under NCCL's point-to-point rules is tests/pipeline/test_nccl_schedules.py's job."""

import pytest

from megatron_ul.pipeline.model import chunk_layer_numbers
from megatron_ul.pipeline.schedules import interleaved_order, interleaved_steps, one_f_one_b_order


def orders(p: int, m: int, v: int, forward_only: bool = False):
    if v == 1:
        return [one_f_one_b_order(p, r, m, forward_only) for r in range(p)]
    return [interleaved_order(p, r, m, v, forward_only) for r in range(p)]


@pytest.mark.parametrize(
    "p,m,v", [(2, 4, 1), (4, 8, 1), (4, 2, 1), (2, 4, 2), (4, 8, 2), (2, 8, 3), (4, 4, 2)]
)
def test_orders_are_complete(p, m, v):
    per_rank = orders(p, m, v)
    for order in per_rank:
        forwards = [(c, i) for op, c, i in order if op == "F"]
        backwards = [(c, i) for op, c, i in order if op == "B"]
        everything = sorted((c, i) for c in range(v) for i in range(m))
        assert sorted(forwards) == everything and sorted(backwards) == everything
        for c, i in backwards:
            assert order.index(("F", c, i)) < order.index(("B", c, i))
    for order in orders(p, m, v, forward_only=True):
        assert order == [("F", c, i) for op, c, i in order]


def test_interleaved_steady_steps_pair_a_forward_with_the_next_backward():
    steps = interleaved_steps(2, 0, 4, 2)  # warm-up 2·(2-0-1) + (2-1)·2 = 4
    assert [len(step) for step in steps] == [1] * 4 + [2] * 4 + [1] * 4
    assert all(step[0][0] == "F" and step[1][0] == "B" for step in steps[4:8])
    assert [op for step in steps for op in step] == interleaved_order(2, 0, 4, 2)
    assert all(len(step) == 1 for step in interleaved_steps(2, 0, 2, 2))  # m == PP: no 1F1B


def test_one_f_one_b_warmup_is_megatrons():
    order = one_f_one_b_order(4, 0, 8)
    assert [op for op, _, _ in order[:4]] == ["F", "F", "F", "F"]  # PP - r - 1 = 3, then 1F1B
    assert order[4][0] == "B"
    last = one_f_one_b_order(4, 3, 8)
    assert [op for op, _, _ in last[:4]] == ["F", "B", "F", "B"]


def test_interleaved_chunks_hold_megatrons_layer_blocks():
    # 8 layers, PP 2, 2 layers per virtual stage: rank 0 holds blocks 0 and 2, rank 1 blocks 1, 3
    assert chunk_layer_numbers(8, 2, 2, 0, 0) == [1, 2]
    assert chunk_layer_numbers(8, 2, 2, 1, 0) == [3, 4]
    assert chunk_layer_numbers(8, 2, 2, 0, 1) == [5, 6]
    assert chunk_layer_numbers(8, 2, 2, 1, 1) == [7, 8]
    assert chunk_layer_numbers(8, 4, 1, 2, 0) == [5, 6]
