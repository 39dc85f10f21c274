"""--optimizer-cpu-offload: fp32 main parameters and Adam state in host memory, the step there.
On a CPU run the host is the device, so training must be bit-identical to the on-device
optimizer (plain DP, ZeRO-1 and ZeRO-2, fp32 and bf16, all or part of the parameters), and a
checkpoint written with offload resumes without it, and the other way round, bitwise."""

import os

import pytest
import torch.distributed as dist

from megatron_ul.checkpoint import files
from megatron_ul.config import ConfigError
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.runs import TINY
from tests.distributed import run_distributed
from tests.training.equivalence import train_and_collect

OFFLOAD = ["--optimizer-cpu-offload"]
HALF = ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]
CASES = {  # name -> (flags of both runs, offload flags)
    "DP2": ([], OFFLOAD),
    "DP2-half-of-the-parameters": ([], HALF),
    "bf16-DP2": (["--bf16"], OFFLOAD),
    # small buckets so that half of the shard's buckets go to the host
    "ZeRO1-DP2": (["--use-distributed-optimizer", "--ddp-bucket-size", "2000"], HALF),
    "bf16-ZeRO1-DP2": (["--bf16", "--use-distributed-optimizer"], OFFLOAD),
    "ZeRO2-DP2": (["--zero-stage", "2", "--ddp-bucket-size", "2000"], HALF),
    "bf16-ZeRO2-DP2": (["--bf16", "--zero-stage", "2"], OFFLOAD),
}


def offload_against_device(rank: int, world: int, cases: dict) -> dict:
    out = {}
    for name, (flags, offload) in cases.items():
        argv = TINY + ["--train-iters", "3"] + flags
        runs = [train_and_collect(rank, world, argv + extra) for extra in ([], offload)]
        out[name] = [(r["losses"], r["shards"]) for r in runs]
    return out


def check_bit_identical(cases: dict) -> None:
    results = run_distributed(offload_against_device, 2, cases)
    for name in cases:
        (device_losses, on_device), (host_losses, on_host) = results[0][name]
        assert host_losses == device_losses, name
        assert on_host.keys() == on_device.keys()
        for key, (value, _, _) in on_device.items():
            assert on_host[key][0].equal(value), f"{name}: {key}"


def test_offloaded_step_is_bit_identical_on_cpu():
    check_bit_identical({n: CASES[n] for n in ("DP2-half-of-the-parameters", "bf16-ZeRO1-DP2")})


@pytest.mark.slow
def test_offloaded_step_is_bit_identical_on_cpu_in_every_case():
    check_bit_identical(CASES)


def resume_across_offload(rank: int, world: int, tmp: str) -> dict:
    """4 iterations saving at 2 with and without offload; each resumed by the other."""
    out = {}
    for name, (save_extra, load_extra) in {
        "saved-without": ([], OFFLOAD),
        "saved-with": (OFFLOAD, []),
    }.items():
        save_dir = os.path.join(tmp, name)
        argv = TINY + ["--bf16", "--use-distributed-optimizer", "--train-iters", "4"]
        full = setup(
            configure(argv + save_extra + ["--save", save_dir, "--save-interval", "2"], world)
        ).train()
        dist.barrier()
        if rank == 0:
            files.write_tracker(save_dir, 2)
        dist.barrier()
        resumed = setup(configure(argv + load_extra + ["--load", save_dir], world)).train()
        out[name] = (full, resumed)
    return out


def test_offload_and_on_device_checkpoints_resume_each_other_bitwise(tmp_path):
    results = run_distributed(resume_across_offload, 2, str(tmp_path))
    for name, (full, resumed) in results[0].items():
        assert resumed == full[2:], name


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--optimizer-offload-fraction", "0.5"],
            "--optimizer-offload-fraction needs --optimizer-cpu-offload",
        ),
        (
            OFFLOAD + ["--optimizer-offload-fraction", "1.5"],
            r"--optimizer-offload-fraction must "
            r"be in \[0, 1\]",
        ),
        (OFFLOAD + ["--zero-stage", "3"], "--optimizer-cpu-offload with --zero-stage 3"),
    ],
)
def test_bad_offload_flags_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        configure(TINY + ["--train-iters", "1", "--lr-warmup-iters", "0"] + flags, 1)
