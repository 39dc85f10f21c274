"""An MoE layer's forward makes one host sync, the experts' row counts (the all-to-all's split
sizes), and backward none: counted over whole training steps on the stand-in device
(tests/stand_ins/host_sync.py), beside the step's loss and grad norm; and no collective is
handed host memory."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.distributed import run_distributed
from tests.stand_ins.host_memory import refuse_host_tensors
from tests.training.equivalence import BASE, LLAMA_GQA
from tests.training.test_host_syncs import STEPS, _count_syncs, _label

MOE = ["--num-experts", "4", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]
COUNTS = ("tolist", "megatron_ul/model/moe/dispatcher.py:dispatch")
LAYOUTS = {  # flags, world, micro-batches per rank and step
    "alltoall DP2-EP2": (
        ["--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2"],
        2,
        2,
    ),
    "allgather SP2-EP2": (
        ["--ds-sequence-parallel-size", "2", "--expert-model-parallel-size", "2"],
        2,
        4,
    ),
}


def _count_refusing_host_tensors(rank: int, world: int, argv: list[str]):
    """What NCCL needs as well: no host tensor (a count made with torch.tensor, say) reaches
    a collective (the stand-in marks host memory; tests/stand_ins/host_memory.py)."""
    with refuse_host_tensors():
        return _count_syncs(rank, world, argv)


@pytest.mark.parametrize(
    "layout", ["alltoall DP2-EP2", pytest.param("allgather SP2-EP2", marks=pytest.mark.slow)]
)
def test_moe_layer_syncs_once_per_forward(layout):
    flags, world, micro_batches = LAYOUTS[layout]
    argv = BASE + LLAMA_GQA + MOE + ["--train-iters", str(STEPS)] + flags
    for seen, _ in run_distributed(_count_refusing_host_tensors, world, argv):
        for step in range(STEPS):
            syncs = Counter(_label(what, where) for s, what, where in seen if s == step)
            assert syncs == {"loss": 1, "grad norm": 1, COUNTS: 2 * micro_batches}, syncs
