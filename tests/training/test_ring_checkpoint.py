"""Parameters do not depend on the Ulysses or ring degree: a checkpoint saved at U2 (DP2)
resumes at R2 (DP2) and at U2×R2 with ZeRO-1, continuing the loss curve within 1e-5."""

import pytest
import torch.distributed as dist

from megatron_ul.checkpoint import files
from tests.checkpoint.runs import NO_DROPOUT, TINY, assert_continues_the_curve, train
from tests.distributed import run_distributed

ARGV = (
    TINY
    + NO_DROPOUT
    + [
        "--position-embedding-type",
        "rope",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--untie-embeddings-and-output-weights",
        "--group-query-attention",
        "--num-query-groups",
        "2",
    ]
)
RESUMED_AT = {
    "R2": ["--context-parallel-size", "2"],
    "U2-R2-zero1": [
        "--ds-sequence-parallel-size",
        "2",
        "--context-parallel-size",
        "2",
        "--use-distributed-optimizer",
    ],
}


def _save_at_u2_resume_on_rings(rank, world, save_dir):
    out = {
        "original": train(
            rank,
            world,
            ARGV
            + [
                "--ds-sequence-parallel-size",
                "2",
                "--train-iters",
                "4",
                "--save",
                save_dir,
                "--save-interval",
                "2",
            ],
        )
    }
    dist.barrier()
    if rank == 0:  # make iteration 2 the latest, as if the first run had stopped there
        files.write_tracker(save_dir, 2)
    dist.barrier()
    for name, flags in RESUMED_AT.items():
        out[name] = train(rank, world, ARGV + flags + ["--train-iters", "4", "--load", save_dir])
    return out


@pytest.mark.slow  # 4 ranks, three resumes; the ring layouts themselves: test_ring_equivalence
def test_checkpoint_saved_with_ulysses_resumes_with_a_ring(tmp_path):
    assert_continues_the_curve(run_distributed(_save_at_u2_resume_on_rings, 4, str(tmp_path))[0])
