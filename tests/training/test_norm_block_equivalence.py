"""RMSNorm's backward over blocks of rows (model/norms.py), forced to its most blocks, in
training: one process and SP 2 reproduce the one-process run with one block, per-step loss
within 1e-5 and final parameters within 1e-5 (relative), fp32."""

from megatron_ul.model import norms
from tests.distributed import run_distributed
from tests.training.equivalence import (
    BASE,
    LLAMA_GQA,
    compare,
    merge_tp_shards,
    one_process_reference,
    train_and_collect,
)


def _train_in_blocks(rank: int, world: int, argv: list) -> dict:
    norms.BACKWARD_BLOCK_ELEMENTS = 1  # as many blocks as allowed (BACKWARD_MAX_BLOCKS)
    return train_and_collect(rank, world, argv)


def test_blocked_norm_backward_trains_like_one_block():
    for world, flags in ((1, []), (2, ["--ds-sequence-parallel-size", "2"])):
        results = run_distributed(_train_in_blocks, world, BASE + LLAMA_GQA + flags)
        candidate = (results[0]["losses"], merge_tp_shards(results))
        loss_diff, param_diff = compare(one_process_reference(LLAMA_GQA), candidate, 8, 2)
        print(f"world {world}: max loss diff {loss_diff:.2e}, param rel diff {param_diff:.2e}")
        assert loss_diff < 1e-5
        assert param_diff < 1e-5
