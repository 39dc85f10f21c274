"""The real pipeline schedules complete under NCCL's point-to-point rules (the stand-in in
tests/stand_ins/nccl_p2p.py: in-order per communicator, rendezvous sends, tags ignored) and
reproduce one process's loss and gradients, for 1F1B on PP2 and PP4 and the interleaved schedule,
with m >= 2·PP micro-batches. The communication pattern the schedules used before (a lone isend
per result, a blocking recv per input) deadlocks under the same rules."""

import pytest
import torch
import torch.distributed as dist

from megatron_ul.pipeline.schedules import interleaved_order, one_f_one_b_order
from tests.pipeline.nccl_harness import run_pipeline, run_reference
from tests.stand_ins.nccl_p2p import Deadlock, Group, run_ranks

LAYOUTS = [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8)]  # (PP, model chunks, micro-batches)
SLOW_LAYOUTS = [(2, 1, 1), (3, 1, 6), (2, 3, 4), (3, 2, 6), (4, 2, 4), (4, 1, 2)]


def check_schedule(pp, chunks, m, forward_only=False):
    loss, grads = run_pipeline(pp, chunks, m, forward_only=forward_only)
    ref_loss, ref_grads = run_reference(pp * chunks, m)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    if forward_only:
        return
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("pp,chunks,m", LAYOUTS)
def test_schedule_completes_under_nccl_rules_and_matches_one_process(pp, chunks, m):
    check_schedule(pp, chunks, m)


@pytest.mark.parametrize("pp,chunks", [(4, 1), (4, 2)])
def test_forward_only_schedule_completes_under_nccl_rules(pp, chunks):
    check_schedule(pp, chunks, 2 * pp, forward_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("pp,chunks,m", SLOW_LAYOUTS)
def test_more_schedules_complete_under_nccl_rules(pp, chunks, m):
    check_schedule(pp, chunks, m)
    check_schedule(pp, chunks, m, forward_only=True)


# ---- the pattern the schedules had: isend each result, blocking recv each input ---------------
def _lone_sends_and_receives(pp, chunks, m, eager_bytes=0):
    group = Group(tuple(range(pp)))
    last = pp * chunks - 1

    def rank_body(rank):
        order = (
            one_f_one_b_order(pp, rank, m)
            if chunks == 1
            else interleaved_order(pp, rank, m, chunks)
        )
        pending = []
        for op, c, _ in order:
            stage = c * pp + rank
            receives, sends = (stage > 0, stage < last) if op == "F" else (stage < last, stage > 0)
            toward_next = op == "F"
            if receives:
                dist.recv(
                    torch.empty(8, 2, 16),
                    (rank - 1 if toward_next else rank + 1) % pp,
                    group=group,
                    tag=1 if toward_next else 2,
                )
            if sends:
                pending.append(
                    dist.isend(
                        torch.zeros(8, 2, 16),
                        (rank + 1 if toward_next else rank - 1) % pp,
                        group=group,
                        tag=1 if toward_next else 2,
                    )
                )
        for request in pending:
            request.wait()

    run_ranks(rank_body, pp, eager_bytes=eager_bytes)


@pytest.mark.parametrize("pp,chunks,m", LAYOUTS)
def test_lone_isend_and_blocking_recv_deadlock_under_nccl_rules(pp, chunks, m):
    with pytest.raises(Deadlock, match="rank 0 waits for"):
        _lone_sends_and_receives(pp, chunks, m)
    # What gloo and tiny test messages show: with sends that fit NCCL's buffer it completes.
    _lone_sends_and_receives(pp, chunks, m, eager_bytes=8 * 2 * 16 * 4)
