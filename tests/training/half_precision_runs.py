"""Runs for the --bf16/--fp16 equivalence tests: the equivalence harness, with every parameter
compared at the model's precision (ZeRO-3 holds fp32 shards, the other layouts half-precision
parameters: both are rounded to the half dtype before they are compared)."""

from __future__ import annotations

import torch

from tests.training.equivalence import run_layout

HALF = {
    "bf16": (["--bf16"], torch.bfloat16),
    "fp16": (["--fp16", "--initial-loss-scale", "4096"], torch.float16),
}


def run_half(argv: list[str], world: int, precision: str):
    flags, dtype = HALF[precision]
    losses, params = run_layout(argv + flags, world)
    return losses, {n: p.to(dtype).float() for n, p in params.items()}


def max_diffs(reference, candidate) -> tuple[float, float]:
    """(max per-step |loss diff|, max over tensors of max|diff| / max|reference|)."""
    ref_losses, ref_params = reference
    losses, params = candidate
    assert params.keys() == ref_params.keys()
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    param_diff = max(
        float((params[n] - r).abs().max() / r.abs().max()) for n, r in ref_params.items()
    )
    return loss_diff, param_diff
