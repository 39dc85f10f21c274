"""The ring's k/v and dk/dv exchange completes under NCCL's point-to-point rules (the stand-in in
tests/stand_ins/nccl_p2p.py: in-order per communicator, rendezvous sends, tags ignored) at R = 2
and R = 4, forward and backward, and still equals plain causal attention on the full sequence."""

import pytest

from megatron_ul.data.sequence_layout import ring_local_positions
from megatron_ul.model.attention.layer import ring_attention
from megatron_ul.model.attention.ring import Ring
from tests.dense_masks import dense_document_mask
from tests.model.test_ring_attention import _compare, documents, window_mask
from tests.stand_ins.nccl_p2p import Group, run_ranks


def _ring_rank(size: int, group: Group):
    def body(rank: int):
        ring = Ring(group, rank, size, (rank + 1) % size, (rank - 1) % size)
        positions = ring_local_positions(rank, size, 32)
        for docs, window, (hq, hk) in [(None, None, (4, 4)), (documents((5, 19), (0,)), 5, (4, 2))]:
            _compare(
                lambda q, k, v, d=docs, w=window: ring_attention(
                    q, k, v, ring, documents=d, window=w
                ),
                positions,
                hq,
                hk,
                window_mask(window, None if docs is None else dense_document_mask(docs)),
                f"R={size} documents={docs is not None} window={window}",
            )

    return body


@pytest.mark.parametrize("size", [2, 4])
def test_ring_forward_and_backward_complete_under_nccl_rules(size):
    run_ranks(_ring_rank(size, Group(tuple(range(size)))), size)
