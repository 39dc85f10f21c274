"""Dropout streams: the default generator matches across TP ranks (replicated activations) and
differs across SP ranks (different tokens); the model-parallel stream differs across TP and SP
ranks (different heads / sequence chunks) and forking it leaves the default stream untouched."""

import torch

from megatron_ul.mpu import parallel_state as ps
from megatron_ul.mpu.random import get_rng_tracker, model_parallel_seed
from tests.distributed import run_distributed


def _draws(rank, world):
    dims = ps.initialize_model_parallel(2, 2, 1)
    model_parallel_seed(1234, dims)
    default_a = torch.rand(4)
    with get_rng_tracker().fork():
        forked = torch.rand(4)
    default_b = torch.rand(4)
    model_parallel_seed(1234, dims)
    torch.rand(4)
    replay = torch.rand(4)  # the fork did not advance the default stream
    return {
        "tp": dims.tp_rank,
        "sp": dims.sp_rank,
        "default": default_a,
        "forked": forked,
        "default_b": default_b,
        "replay": replay,
    }


def test_rng_streams_match_and_differ_where_they_must():
    results = run_distributed(_draws, 4)
    by = {(r["tp"], r["sp"]): r for r in results}
    for sp in (0, 1):
        assert torch.equal(by[(0, sp)]["default"], by[(1, sp)]["default"])
        assert not torch.equal(by[(0, sp)]["forked"], by[(1, sp)]["forked"])
    assert not torch.equal(by[(0, 0)]["default"], by[(0, 1)]["default"])
    assert not torch.equal(by[(0, 0)]["forked"], by[(0, 1)]["forked"])
    for r in results:
        assert torch.equal(r["default_b"], r["replay"])
