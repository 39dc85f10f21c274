"""The pipelined operation orders: every (chunk, micro-batch) runs forward then backward once,
the warm-up matches Megatron, and all ranks' orders together complete without deadlock when
run with asynchronous sends and blocking receives (simulated message passing, FIFO per link and
tag, checking that each received message is the one the receiver expects)."""
from collections import deque

import pytest

from megatron_ul.pipeline.model import chunk_layer_numbers
from megatron_ul.pipeline.schedules import interleaved_order, one_f_one_b_order


def orders(p: int, m: int, v: int, forward_only: bool = False):
    if v == 1:
        return [one_f_one_b_order(p, r, m, forward_only) for r in range(p)]
    return [interleaved_order(p, r, m, v, forward_only) for r in range(p)]


def simulate(p: int, v: int, per_rank: list[list]) -> None:
    """Run the orders as p2p.py does; fail on deadlock or on a mismatched message."""
    links = {}                  # (src, dst, tag) -> deque of (chunk, micro-batch) sent
    position = [0] * p
    last_stage = p * v - 1

    def link(src, dst, tag):
        return links.setdefault((src, dst, tag), deque())

    while any(position[r] < len(per_rank[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if position[r] == len(per_rank[r]):
                continue
            op, c, i = per_rank[r][position[r]]
            stage = c * p + r                       # virtual stage of this chunk
            needs = (stage > 0) if op == "F" else (stage < last_stage)
            if needs:
                src = (r - 1) % p if op == "F" else (r + 1) % p
                queue = link(src, r, op)
                if not queue:
                    continue                        # blocked on a receive
                assert queue.popleft() == (c, i), f"rank {r} got the wrong message for {op}"
            sends = (stage < last_stage) if op == "F" else (stage > 0)
            if sends:
                dst = (r + 1) % p if op == "F" else (r - 1) % p
                next_stage = stage + 1 if op == "F" else stage - 1
                link(r, dst, op).append((next_stage // p, i))
            position[r] += 1
            progressed = True
        assert progressed, f"deadlock at positions {position}"
    assert all(not q for q in links.values()), "messages left unreceived"


@pytest.mark.parametrize("p,m,v", [(2, 4, 1), (4, 8, 1), (4, 2, 1), (2, 4, 2), (4, 8, 2),
                                   (2, 8, 3), (4, 4, 2)])
def test_orders_are_complete_and_deadlock_free(p, m, v):
    per_rank = orders(p, m, v)
    for order in per_rank:
        forwards = [(c, i) for op, c, i in order if op == "F"]
        backwards = [(c, i) for op, c, i in order if op == "B"]
        everything = sorted((c, i) for c in range(v) for i in range(m))
        assert sorted(forwards) == everything and sorted(backwards) == everything
        for c, i in backwards:
            assert order.index(("F", c, i)) < order.index(("B", c, i))
    simulate(p, v, per_rank)
    simulate(p, v, orders(p, m, v, forward_only=True))


def test_one_f_one_b_warmup_is_megatrons():
    order = one_f_one_b_order(4, 0, 8)
    assert [op for op, _, _ in order[:4]] == ["F", "F", "F", "F"]   # PP - r - 1 = 3, then 1F1B
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
