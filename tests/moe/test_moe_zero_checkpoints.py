"""ZeRO-1/2 with expert parallelism in checkpoints: the experts' Adam state and main weights,
sharded over expert-DP, are gathered under their global names. A ZeRO-1 EP 2 checkpoint
resumes on ZeRO-1 EP 2 bit-exactly, and on plain data parallelism at EP 1, on ZeRO-2 EP 2 and
on ZeRO-3 EP 2 on the original loss curve (fp32, 1e-5); ZeRO-3 EP 2's own checkpoint resumes
on ZeRO-1 EP 2."""

import os

import pytest
import torch.distributed as dist

from megatron_ul.checkpoint import files
from tests.checkpoint.runs import NO_DROPOUT, TINY, train
from tests.distributed import run_distributed
from tests.moe.test_moe_checkpoints import MOE

ARGV = TINY + NO_DROPOUT + MOE + ["--train-iters", "4", "--clip-grad", "0.05"]
EP2 = ["--expert-model-parallel-size", "2"]


def _resumes(rank: int, world: int, argv: list[str], tmp: str) -> dict:
    """ZeRO-1 EP 2 (DP 4: two expert-DP replicas) saves at 2; three runs resume it."""
    save = os.path.join(tmp, "zero1-ep2")
    zero1 = ["--zero-stage", "1"] + EP2
    out = {"original": train(rank, world, argv + zero1 + ["--save", save, "--save-interval", "2"])}
    dist.barrier()
    if dist.get_rank() == 0:
        files.write_tracker(save, 2)
    dist.barrier()
    out["zero1-ep2"] = train(rank, world, argv + zero1 + ["--load", save])
    out["zero2-ep2"] = train(rank, world, argv + ["--zero-stage", "2"] + EP2 + ["--load", save])
    out["plain-ep1"] = train(rank, world, argv + ["--load", save])
    # ZeRO-3 EP 2 (experts on an expert-DP mesh) loads it and saves 3; ZeRO-1 EP 2 resumes that
    zero3, save3 = ["--zero-stage", "3"] + EP2, os.path.join(tmp, "zero3-ep2")
    out["zero3-ep2"] = train(
        rank, world, argv + zero3 + ["--load", save, "--save", save3, "--save-interval", "1"]
    )
    dist.barrier()
    if dist.get_rank() == 0:
        files.write_tracker(save3, 3)
    dist.barrier()
    out["zero1-from-zero3"] = train(rank, world, argv + zero1 + ["--load", save3])
    return out


@pytest.mark.slow
def test_zero_expert_checkpoints_resume(tmp_path):
    out = run_distributed(_resumes, 4, ARGV, str(tmp_path))[0]
    original = out.pop("original")
    print(original, out)
    assert len(original) == 4
    assert out["zero1-ep2"] == original[2:], out["zero1-ep2"]  # bit-exact
    for name, start in (
        ("zero2-ep2", 2),
        ("plain-ep1", 2),
        ("zero3-ep2", 2),
        ("zero1-from-zero3", 3),
    ):
        diff = max(abs(a - b) for a, b in zip(out[name], original[start:]))
        print(f"{name}: max diff {diff:.2e}")
        assert len(out[name]) == 4 - start and diff < 1e-5, name


def _bf16_resumes(rank: int, world: int, argv: list[str], tmp: str) -> dict:
    """--bf16: the experts' fp32 main weights are ZeRO-1 pieces over expert-DP."""
    save, zero1 = os.path.join(tmp, "bf16"), ["--zero-stage", "1"] + EP2
    out = {"original": train(rank, world, argv + zero1 + ["--save", save, "--save-interval", "2"])}
    dist.barrier()
    if dist.get_rank() == 0:
        files.write_tracker(save, 2)
    dist.barrier()
    out["zero1-ep2"] = train(rank, world, argv + zero1 + ["--load", save])
    return out


@pytest.mark.slow
def test_zero_expert_main_weights_resume_bitwise_in_bf16(tmp_path):
    out = run_distributed(_bf16_resumes, 4, ARGV + ["--bf16"], str(tmp_path))[0]
    assert out["zero1-ep2"] == out["original"][2:], out
