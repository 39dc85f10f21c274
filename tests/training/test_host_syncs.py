"""Whole training steps make only the host syncs a step needs: the reported loss and the grad
norm, once per step each, and one non-blocking host->device copy of the step's batches.
Counted on a stand-in device (tests/stand_ins/host_sync.py) over real training steps, data
loading included, with document masking on, in one process, PP 2 (plain and interleaved) and
SP 2 with ZeRO-1."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from megatron_ul.training import loop
from megatron_ul.training.data import to_device
from megatron_ul.training.pretrain import configure, setup
from tests.distributed import run_distributed
from tests.stand_ins.host_sync import count_host_syncs
from tests.training.equivalence import BASE, DOCUMENTS, GPT2_STYLE

STEPS = 3
# The syncs a step needs: the loss as a float (train_step returns it, stops on NaN, logs it)
# and the grad norm as a float (clipping's coefficient is decided on the host, as Megatron's
# clip_grad_norm_fp32 does, and it is returned and logged). Everything else stays on the device.
LOSS = ("__float__", "megatron_ul/training/step.py:global_mean_loss")
NORMS = ("megatron_ul/optim/grads.py:", "megatron_ul/optim/distributed_optimizer.py:")

LAYOUTS = {
    "one process": ([], 1),
    "PP2": (["--pipeline-model-parallel-size", "2"], 2),
    "PP2 interleaved": (
        [
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers",
            "4",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
        ],
        2,
    ),
    "SP2 ZeRO-1": (["--ds-sequence-parallel-size", "2", "--use-distributed-optimizer"], 2),
}
DEFAULT = {"one process", "PP2"}


def _count_syncs(rank: int, world: int, argv: list[str]) -> tuple[list, list]:
    trainer = setup(configure(argv, world))
    train_step = loop.train_step

    with count_host_syncs() as syncs:

        def counted_step(*args, **kwargs):
            result = train_step(*args, **kwargs)
            syncs.step += 1  # what follows (the next batch's loading included) is the next step
            return result

        loop.train_step = counted_step
        try:
            trainer.train()
        finally:
            loop.train_step = train_step
    return syncs.seen, syncs.copies


def _label(what: str, where: str):
    """The loss's sync, the grad norm's, or the site itself for any other."""
    if (what, where) == LOSS:
        return "loss"
    if what == "item" and where.startswith(NORMS):
        return "grad norm"
    return (what, where)


@pytest.mark.parametrize(
    "layout",
    [pytest.param(name, marks=() if name in DEFAULT else pytest.mark.slow) for name in LAYOUTS],
)
def test_a_training_step_syncs_only_for_its_loss_and_grad_norm(layout):
    flags, world = LAYOUTS[layout]
    argv = BASE + GPT2_STYLE + DOCUMENTS + ["--train-iters", str(STEPS)] + flags
    per_rank = run_distributed(_count_syncs, world, argv)
    for rank, (seen, copies) in enumerate(per_rank):
        for step in range(STEPS):
            syncs = Counter(_label(what, where) for s, what, where in seen if s == step)
            moved = Counter(
                ("blocking" if blocking else "non-blocking", where)
                for s, blocking, where in copies
                if s == step
            )
            print(f"{layout} rank {rank} step {step}: {dict(syncs)}; copies {dict(moved)}")
            assert syncs == Counter({"loss": 1, "grad norm": 1}), (layout, rank, step)
            assert moved == Counter({("non-blocking", "megatron_ul/training/data.py:to_device"): 1})


def test_one_copy_moves_every_tensor_exactly():
    """Odd byte counts (the next tensor starts aligned), every dtype a batch holds, and the
    non-tensor host offsets kept as they are."""
    generator = torch.Generator().manual_seed(0)
    micro_batches = [
        {
            "tokens": torch.randint(0, 1000, (3, 5), generator=generator),
            "loss_mask": torch.rand(3, 5, generator=generator),
            "cu_seqlens": torch.tensor([0, 4, 9, 15], dtype=torch.int32),
            "document_offsets": [0, 4, 9, 15],
            "flags": torch.rand(7, generator=generator) > 0.5,
            "half": torch.rand(3, generator=generator).to(torch.bfloat16),
        }
        for _ in range(2)
    ]
    moved = to_device(micro_batches, torch.device("cpu"))
    for before, after in zip(micro_batches, moved):
        assert before.keys() == after.keys()
        for key, value in before.items():
            if isinstance(value, torch.Tensor):
                assert after[key].dtype == value.dtype and after[key].is_contiguous()
                assert torch.equal(after[key], value), key
            else:
                assert after[key] is value
