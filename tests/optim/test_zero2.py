"""ZeRO-2 (--zero-stage 2): each rank keeps only its 1/N shard of the fp32 gradient — no
parameter holds a gradient between micro-batches, every bucket being reduce-scattered as soon
as its micro-batch gradient is complete — and the overlapped reduction gives the same bits.
Its equivalence to one process (within 1e-5) is in test_zero_equivalence.py."""

from functools import partial

import pytest
import torch

from megatron_ul.pipeline.model import global_named_parameters
from megatron_ul.training.memory_estimator import estimate_config
from megatron_ul.training.pretrain import configure, setup
from tests.distributed import run_distributed
from tests.training.equivalence import BASE, GPT2_STYLE

# DP2, 2 micro-batches per rank and step, buckets of ~20K elements (about ten)
ARGV = BASE + GPT2_STYLE + ["--train-iters", "3", "--ddp-bucket-size", "20000"]
ZERO2 = ["--zero-stage", "2"]
CASES = {
    "zero2": ZERO2,
    "zero2-overlap": ZERO2 + ["--overlap-grad-reduce", "--overlap-param-gather"],
    "zero1": ["--use-distributed-optimizer"],
    "zero2-bf16": ZERO2 + ["--bf16"],
    "zero1-bf16": ["--use-distributed-optimizer", "--bf16"],
}


def _count_held(model, held: list, _module, _args) -> None:
    held.append(sum(p.grad.numel() for p in model.parameters() if p.grad is not None))


def _train(rank: int, world: int, cases: dict) -> dict:
    out = {}
    for name, flags in cases.items():
        trainer = setup(configure(ARGV + flags, world))
        model, optimizer = trainer.model, trainer.optimizer
        held_at_forward: list[int] = []  # gradient elements held when a micro-batch starts
        model.register_forward_pre_hook(partial(_count_held, model, held_at_forward))
        losses = trainer.train()
        shard = getattr(optimizer, "grad_shard", None)
        out[name] = {
            "losses": losses,
            "params": {n: p.detach().clone() for n, p in global_named_parameters(model)},
            "held_at_forward": held_at_forward,
            "shard": None if shard is None else shard.numel(),
            "padded": optimizer.param_buffer.numel(),
        }
    return out


def test_zero2_keeps_gradient_shards_only_and_overlap_changes_no_bit():
    cases = {k: CASES[k] for k in ("zero2", "zero2-overlap")}
    zero2, overlapped = run_distributed(_train, 2, cases)[0].values()
    # Only the shard: a half of the padded buffer per rank, nothing left on the parameters
    # when a micro-batch starts (ZeRO-1's parameters hold views of a full-size buffer).
    assert zero2["shard"] == zero2["padded"] // 2
    assert len(zero2["held_at_forward"]) == 6 and max(zero2["held_at_forward"]) == 0
    # The estimator's ZeRO-2 gradient term is that shard (fp32; the buffer pads each bucket
    # to a multiple of the group size).
    estimate = estimate_config(configure(ARGV + ZERO2, 2))
    assert abs(4 * zero2["shard"] / estimate.gradient_bytes - 1) < 1e-3
    # The same reduce-scatters in the same order, waited for later: the same bits.
    assert overlapped["losses"] == zero2["losses"]
    for name, p in zero2["params"].items():
        assert torch.equal(overlapped["params"][name], p), name


@pytest.mark.slow
def test_zero2_against_zero1_in_fp32_and_bf16():
    """The same sums in another order (per micro-batch, then over micro-batches); bf16:
    fp32 accumulation in the shard, bf16 weights within a rounding or two of ZeRO-1's."""
    cases = {k: CASES[k] for k in ("zero2", "zero1", "zero2-bf16", "zero1-bf16")}
    zero2, zero1, bf16, bf16_zero1 = run_distributed(_train, 2, cases)[0].values()
    assert min(zero1["held_at_forward"]) > 0  # ZeRO-1's gradients are views of its buffer
    for a, b in zip(zero2["losses"], zero1["losses"]):
        assert abs(a - b) < 1e-5
    for name, p in zero1["params"].items():
        assert float((zero2["params"][name] - p).abs().max() / p.abs().max()) < 1e-5, name
    for a, b in zip(bf16["losses"], bf16_zero1["losses"]):
        assert abs(a - b) < 1e-3 * abs(b)
    for name, p in bf16_zero1["params"].items():
        q = bf16["params"][name]
        assert p.dtype == q.dtype == torch.bfloat16
        assert float((q.float() - p.float()).abs().max() / p.float().abs().max()) < 2e-2, name
