"""Measure what a model really holds: parameter, gradient and Adam bytes after one step, and
the bytes autograd keeps for backward per transformer layer (saved_tensors_hooks, each storage
counted once, parameters excluded). Compared with training/memory_estimator.py."""

from __future__ import annotations

import torch

from ..initialize import initialize_distributed
from ..optim import build_optimizer
from ..pipeline.schedules import micro_batch_loss_sum
from .data import build_datasets, global_batches
from .pretrain import build_model, configure


class SavedTensorMeter:
    """Attributes every storage autograd saves to the module that was running (first seen)."""

    def __init__(self, model):
        self.current, self.seen, self.bytes = "embedding", set(), {}
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        for i, layer in enumerate(model.layers):
            layer.register_forward_pre_hook(lambda *_, i=i: self._enter(f"layer{i}"))
            layer.register_forward_hook(lambda *_: self._enter("head"))

    def _enter(self, name):
        self.current = name

    def pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.seen and ptr not in self.skip:
            self.seen.add(ptr)
            self.bytes[self.current] = self.bytes.get(self.current, 0) + storage.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def measure(rank: int, world: int, argv: list[str]) -> dict:
    cfg = configure(argv, world)
    device, dims = initialize_distributed(cfg)
    model = build_model(cfg, device, dims)
    optimizer = build_optimizer(model, cfg.train, parallel=None, dims=dims)  # plain AdamW
    train_ds, _, _ = build_datasets(cfg)
    batch = next(global_batches(cfg, dims, train_ds, device, None))[0]
    meter = SavedTensorMeter(model)
    with meter.hooks():
        loss = micro_batch_loss_sum(model, batch)
    loss.backward()
    optimizer.step()
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "saved": meter.bytes,
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "grad_bytes": sum(g.numel() * g.element_size() for g in grads),
        "optimizer_bytes": sum(t.numel() * t.element_size() for t in state),
        "params": sum(p.numel() for p in params),
    }


def measure_many(rank: int, world: int, argvs: list[list[str]]) -> list[dict]:
    """`measure` for several configurations in one set of processes."""
    results = []
    for argv in argvs:
        results.append(measure(rank, world, argv))
    return results
