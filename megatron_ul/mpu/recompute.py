"""Activation recomputation (Megatron's --recompute-*): checkpoint a function, keep only its
inputs, and run it again in backward.

Dropout inside the recomputed region must draw the same masks twice. torch's checkpoint
already replays the default generator (preserve_rng_state); the RNG tracker's named streams
(mpu.random: attention-probability dropout, Megatron-SP dropout) live outside the generator,
so we snapshot them when the forward runs and swap the snapshot in for the recompute, putting
back whatever the tracker holds by then (later layers have advanced it) afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from .offload import offloaded_checkpoint
from .random import get_rng_tracker


def _tracker_contexts():
    """(forward context, recompute context) sharing one snapshot of the tracker's states."""
    snapshot: dict = {}

    @contextmanager
    def forward():
        snapshot["states"] = get_rng_tracker().get_states()
        yield

    @contextmanager
    def recompute():
        tracker = get_rng_tracker()
        current = tracker.get_states()
        tracker.set_states(snapshot["states"])
        try:
            yield
        finally:
            tracker.set_states(current)

    return forward(), recompute()


def checkpoint(function, *args):
    """function(*args) without keeping its intermediate activations; recomputed in backward
    with the default generator and the tracker's streams exactly as they were."""
    if not torch.is_grad_enabled():
        return function(*args)
    return _torch_checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_tracker_contexts
    )


def layers_to_checkpoint(
    num_layers: int, granularity, method, recompute_num_layers: int
) -> list[list[int]]:
    """Megatron's full-recompute plans over this stage's layers, as runs of layer indices.

    uniform: consecutive chunks of `recompute_num_layers` layers, each checkpointed as one unit.
    block: the first `recompute_num_layers` layers each checkpointed alone; the rest not at all.
    Layers in no run are computed normally (also for granularity None or 'selective').
    """
    if granularity != "full":
        return []
    if method == "uniform":
        return [
            list(range(i, min(i + recompute_num_layers, num_layers)))
            for i in range(0, num_layers, recompute_num_layers)
        ]
    return [[i] for i in range(min(recompute_num_layers, num_layers))]


def run_layers(
    layers, x: torch.Tensor, plan: list[list[int]], *args, offloader=None
) -> torch.Tensor:
    """x through every layer in order; each run of indices in `plan` is one checkpoint, whose
    input is kept in host memory when an offloader (mpu.offload.HostOffloader) is given."""
    starts = {run[0]: run for run in plan}
    chain: list = []  # this pass's offloaded inputs, in order
    i = 0
    while i < len(layers):
        run = starts.get(i)
        if run is None:
            x = layers[i](x, *args)
            i += 1
            continue
        chunk = [layers[j] for j in run]

        def forward_chunk(hidden, *inner, chunk=chunk):
            for layer in chunk:
                hidden = layer(hidden, *inner)
            return hidden

        if offloader is not None:
            x = offloaded_checkpoint(forward_chunk, offloader, chain, x, *args)
        else:
            x = checkpoint(forward_chunk, x, *args)
        i += len(run)
    return x
