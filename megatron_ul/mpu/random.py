"""Per-region RNG streams and activation recomputation.

Dropout must *match* across ranks that hold replicas of the same activation and *differ* across
ranks that hold different pieces of it. Two streams:
  - the default generator, seeded identically on all TP ranks of a model replica (and offset by
    SP rank, because SP ranks hold different tokens): hidden dropout on full-hidden activations;
  - the "model-parallel" stream, distinct per (TP, SP) rank: dropout on TP-sharded activations
    (attention probabilities of a slice of heads) and on Megatron-SP sequence chunks.
Works for the CPU generator and, on GPU, the CUDA generator of the current device.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .parallel_state import ParallelDims

MODEL_PARALLEL_RNG = "model-parallel-rng"


def device_rng_get(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def device_rng_set(state: torch.Tensor, device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states that can be swapped in with `fork(name)`."""

    def __init__(self):
        self.states: dict[str, torch.Tensor] = {}
        self.device_type = "cpu"

    def reset(self, device_type: str = "cpu") -> None:
        self.states, self.device_type = {}, device_type

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = device_rng_get(self.device_type)
        if self.device_type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = device_rng_get(self.device_type)
        device_rng_set(saved, self.device_type)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added; call model_parallel_seed() first")
        saved = device_rng_get(self.device_type)
        device_rng_set(self.states[name], self.device_type)
        try:
            yield
        finally:
            self.states[name] = device_rng_get(self.device_type)
            device_rng_set(saved, self.device_type)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_seed(seed: int, dims: ParallelDims, device_type: str = "cpu") -> None:
    """Seed the default generator and the model-parallel stream (Megatron's offsets) for this
    rank's place in `dims`."""
    pp_rank = dims.pp_rank
    sp_rank = dims.sequence_split[0]  # Ulysses × ring: each holds different tokens
    tp_rank, tp = dims.tp_rank, dims.tp
    default_seed = seed + 100 * pp_rank + 1009 * sp_rank
    model_parallel = seed + 2718 + 100 * pp_rank + tp_rank + tp * 1009 * sp_rank
    torch.manual_seed(default_seed)
    if device_type == "cuda":
        torch.cuda.manual_seed(default_seed)
    _TRACKER.reset(device_type)
    _TRACKER.add(MODEL_PARALLEL_RNG, model_parallel)
