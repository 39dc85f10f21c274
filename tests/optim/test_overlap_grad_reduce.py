"""--overlap-grad-reduce (and ZeRO-1's --overlap-param-gather): buckets reduced from backward's
gradient hooks give bit-identical losses and parameters to the same buckets reduced after
backward, with gradient accumulation (several micro-batches per step) and pipelining — and the
hooks really do launch buckets before backward ends."""

import pytest
import torch

from megatron_ul.config import ConfigError
from megatron_ul.optim.distributed_optimizer import DistributedOptimizer
from megatron_ul.pipeline.model import global_named_parameters
from megatron_ul.training.pretrain import configure, setup
from tests.distributed import run_distributed
from tests.training.equivalence import BASE, GPT2_STYLE, LLAMA_GQA

# 2 micro-batches per rank and step at DP2; buckets of ~20K elements: the small models have
# ~10 buckets, so most launch from the hooks.
SMALL_BUCKETS = ["--train-iters", "3", "--ddp-bucket-size", "20000"]
OVERLAP = ["--overlap-grad-reduce"]


def _train(rank, world, argv):
    trainer = setup(configure(argv, world))
    losses = trainer.train()
    optimizer = trainer.optimizer
    launcher = (
        optimizer.launcher
        if isinstance(optimizer, DistributedOptimizer)
        else optimizer.grad_sync.launcher
    )
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in global_named_parameters(trainer.model)},
        "buckets": len(launcher.buckets),
        "by_hooks": launcher.launched_by_hooks,
    }


LAYOUTS = {  # name -> (flags, world)
    "DP2": ([], 2),
    "ZeRO-1 DP2 + param gather": (["--use-distributed-optimizer", "--overlap-param-gather"], 2),
    "SP2-DP2": (["--ds-sequence-parallel-size", "2"], 4),
    "TP2-megatron-SP-DP2": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 4),
    "PP2-DP2": (["--pipeline-model-parallel-size", "2"], 4),
    "ZeRO-1 PP2-DP2": (
        [
            "--pipeline-model-parallel-size",
            "2",
            "--use-distributed-optimizer",
            "--overlap-param-gather",
        ],
        4,
    ),
}
DEFAULT = {"ZeRO-1 DP2 + param gather"}


@pytest.mark.parametrize(
    "layout",
    [pytest.param(name, marks=() if name in DEFAULT else pytest.mark.slow) for name in LAYOUTS],
)
def test_overlapped_reduction_is_bit_identical(layout):
    flags, world = LAYOUTS[layout]
    model = LLAMA_GQA if "TP2" in layout else GPT2_STYLE
    param_gather = [f for f in flags if f != "--overlap-param-gather"]
    # The non-overlapped run takes no --overlap-param-gather (it needs --overlap-grad-reduce).
    plain = run_distributed(_train, world, BASE + model + SMALL_BUCKETS + param_gather)
    overlapped = run_distributed(_train, world, BASE + model + SMALL_BUCKETS + flags + OVERLAP)
    for p, o in zip(plain, overlapped):
        assert o["losses"] == p["losses"]
        assert o["params"].keys() == p["params"].keys()
        for name in p["params"]:
            assert torch.equal(o["params"][name], p["params"][name]), name
        assert p["by_hooks"] == 0
        # All buckets but the tied embedding's (deferred under PP) launched during backward.
        assert p["buckets"] > 2 and o["by_hooks"] >= o["buckets"] - 1, o


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--overlap-param-gather", "--overlap-grad-reduce"], "--use-distributed-optimizer"),
        (["--zero-stage", "3", "--overlap-param-gather", "--overlap-grad-reduce"], "stage 2"),
        (["--use-distributed-optimizer", "--overlap-param-gather"], "--overlap-grad-reduce"),
        (["--overlap-grad-reduce", "--fp16"], "--fp16"),
        (["--ddp-bucket-size", "0"], "--ddp-bucket-size"),
    ],
)
def test_bad_overlap_flags_are_refused(flags, match):
    with pytest.raises(ConfigError, match=match):
        configure(BASE + GPT2_STYLE + flags, 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "save_format",
    [[], ["--ckpt-format", "torch_dist", "--async-save"]],
    ids=["torch", "torch_dist-async"],
)
def test_overlapped_run_saves_and_resumes_bitwise(tmp_path, save_format):
    """A ZeRO-1 run with both overlaps saves and resumes (both formats, async torch_dist): the
    resumed run repeats the uninterrupted losses exactly. (Whether a save waits for gathers
    still in flight is not visible here: gloo's finish before the save reads them.)"""
    from tests.checkpoint.runs import assert_bitwise_resume

    argv = (
        BASE
        + GPT2_STYLE
        + ["--ddp-bucket-size", "20000", "--use-distributed-optimizer"]
        + OVERLAP
        + ["--overlap-param-gather"]
        + save_format
    )
    results = run_distributed(_layouts_resumed, 2, argv, str(tmp_path))
    assert_bitwise_resume(results, ["ZeRO-1 DP2"])


def _layouts_resumed(rank, world, argv, save_dir):
    from tests.checkpoint.runs import train_then_resume

    return {"ZeRO-1 DP2": train_then_resume(rank, world, argv, save_dir, 2, 4)}
