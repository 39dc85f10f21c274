"""The NCCL point-to-point stand-in enforces NCCL's rules, not gloo's: grouped send+recv pairs
complete, a lone send before a receive on both peers is a deadlock named rank by rank, small
messages only pass when they fit the (optional) eager buffer, tags never match anything, and
mismatched or misused buffers are errors."""

import pytest
import torch
import torch.distributed as dist

from tests.stand_ins.nccl_p2p import Deadlock, Group, MessageMismatch, run_ranks

PAIR = Group((0, 1))
RING3 = Group((0, 1, 2))


def _exchange_batched(rank):
    peer = 1 - rank
    out, got = torch.full((4,), float(rank)), torch.empty(4)
    for request in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, out, peer, PAIR), dist.P2POp(dist.irecv, got, peer, PAIR)]
    ):
        request.wait()
    return got


def _exchange_send_first(rank):
    peer = 1 - rank
    got = torch.empty(4)
    request = dist.isend(torch.full((4,), float(rank)), peer, group=PAIR)
    dist.recv(got, peer, group=PAIR)
    request.wait()
    return got


def test_a_batched_exchange_completes_and_delivers():
    got = run_ranks(_exchange_batched, 2)
    assert torch.equal(got[0], torch.full((4,), 1.0))
    assert torch.equal(got[1], torch.full((4,), 0.0))


def test_send_then_receive_on_both_peers_is_a_named_deadlock():
    with pytest.raises(Deadlock) as error:
        run_ranks(_exchange_send_first, 2)
    message = str(error.value)
    for text in (
        "rank 0 waits for",
        "rank 1 waits for",
        "running isend[send #0 0->1",
        "queued irecv[recv #0 1<-0",
    ):
        assert text in message, message


def test_messages_that_fit_the_eager_buffer_hide_the_deadlock():
    got = run_ranks(_exchange_send_first, 2, eager_bytes=16)
    assert torch.equal(got[0], torch.full((4,), 1.0))
    with pytest.raises(Deadlock):
        run_ranks(_exchange_send_first, 2, eager_bytes=15)


def test_a_ring_of_lone_sends_deadlocks_and_a_ring_of_batches_does_not():
    def ring(batched):
        def body(rank):
            nxt, prev = (rank + 1) % 3, (rank - 1) % 3
            out, got = torch.full((2,), float(rank)), torch.empty(2)
            if batched:
                for r in dist.batch_isend_irecv(
                    [
                        dist.P2POp(dist.isend, out, nxt, RING3),
                        dist.P2POp(dist.irecv, got, prev, RING3),
                    ]
                ):
                    r.wait()
            else:
                dist.send(out, nxt, group=RING3)
                dist.recv(got, prev, group=RING3)
            return got

        return body

    assert [g[0].item() for g in run_ranks(ring(True), 3)] == [2.0, 0.0, 1.0]
    with pytest.raises(Deadlock, match="rank 2 waits for send #0 2->0"):
        run_ranks(ring(False), 3)


def _pair(sender, receiver):
    def body(rank):
        if rank == 0:
            sender()
        else:
            receiver()

    return body


def test_tags_do_not_match_messages():
    # gloo would pair these by tag; NCCL delivers the first send into the first receive
    def sender():
        a = dist.isend(torch.zeros(2), 1, group=PAIR, tag=1)
        b = dist.isend(torch.ones(2), 1, group=PAIR, tag=2)
        a.wait(), b.wait()

    def receiver():
        second, first = torch.empty(2), torch.empty(2)
        for r in dist.batch_isend_irecv(
            [dist.P2POp(dist.irecv, second, 0, PAIR, 2), dist.P2POp(dist.irecv, first, 0, PAIR, 1)]
        ):
            r.wait()

    with pytest.raises(MessageMismatch, match="tag 1 != 2"):
        run_ranks(_pair(sender, receiver), 2, eager_bytes=1 << 10)


@pytest.mark.parametrize(
    "shape,dtype,problem", [((3,), torch.float32, "shape"), ((2,), torch.float64, "dtype")]
)
def test_a_mismatched_receive_is_an_error(shape, dtype, problem):
    def sender():
        dist.send(torch.zeros(2), 1, group=PAIR)

    def receiver():
        dist.recv(torch.empty(shape, dtype=dtype), 0, group=PAIR)

    with pytest.raises(MessageMismatch, match=problem):
        run_ranks(_pair(sender, receiver), 2)


def test_a_send_buffer_written_before_completion_is_an_error():
    signal = Group((0, 1))  # another communicator: rank 1 receives only once rank 0 wrote

    def sender():
        buffer = torch.zeros(2)
        request = dist.isend(buffer, 1, group=PAIR)
        buffer.add_(1)
        dist.send(torch.zeros(1), 1, group=signal)
        request.wait()

    def receiver():
        dist.recv(torch.empty(1), 0, group=signal)
        dist.recv(torch.empty(2), 0, group=PAIR)

    with pytest.raises(MessageMismatch, match="written before the send completed"):
        run_ranks(_pair(sender, receiver), 2)


def test_a_receive_buffer_holds_nan_until_its_wait():
    signal = Group((0, 1))  # another communicator: rank 0 sends only once rank 1 looked
    seen = {}

    def sender():
        dist.recv(torch.empty(1), 1, group=signal)
        dist.send(torch.ones(2), 1, group=PAIR)

    def receiver():
        got = torch.empty(2)
        request = dist.irecv(got, 0, group=PAIR)
        seen["before"] = got.clone()
        dist.send(torch.zeros(1), 0, group=signal)
        request.wait()
        seen["after"] = got

    run_ranks(_pair(sender, receiver), 2)
    assert seen["before"].isnan().all()
    assert torch.equal(seen["after"], torch.ones(2))


def test_operations_of_one_communicator_run_in_issue_order():
    # rank 1's send to 2 waits behind its receive from 0, which rank 0 posts last
    def body(rank):
        if rank == 0:
            dist.recv(torch.empty(1), 2, group=RING3)
            dist.send(torch.zeros(1), 1, group=RING3)
        elif rank == 1:
            got = dist.irecv(torch.empty(1), 0, group=RING3)
            dist.send(torch.zeros(1), 2, group=RING3)
            got.wait()
        else:
            dist.recv(torch.empty(1), 1, group=RING3)
            dist.send(torch.zeros(1), 0, group=RING3)

    with pytest.raises(Deadlock, match="queued isend"):
        run_ranks(body, 3)


def test_a_rank_s_own_error_is_raised_rather_than_a_deadlock():
    def body(rank):
        if rank == 0:
            raise KeyError("the rank's own bug")
        dist.recv(torch.empty(1), 0, group=PAIR)

    with pytest.raises(KeyError, match="own bug"):
        run_ranks(body, 2)
