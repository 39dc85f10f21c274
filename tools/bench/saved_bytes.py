"""What a rank holds, measured: model-state bytes (parameters, gradients, optimizer state) and
the bytes autograd saves for backward, the ground truth the memory estimator is checked
against (tests/training/test_memory_estimator.py). One meter of saved bytes, `SavedBytes`:
whole (`saved_activation_bytes`) or per module of a model (`measure`); the live-tensor
tracker (live_tensors.py) measures what is alive op by op instead.

Bytes are counted per storage, so views (ZeRO-1's parameters are views of one flat buffer,
autograd often saves a view and its base) are counted once; DTensors (ZeRO-3) count their
local shard only; the excluded tensors (the parameters: weights saved by matmuls are not
activations) never count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storage_key(t: torch.Tensor) -> tuple:
    s = _local(t).untyped_storage()
    return (t.device.type, s.data_ptr(), s.nbytes())


def storage_bytes(tensors: Iterable[torch.Tensor | None], exclude: set | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (skipping keys in `exclude`)."""
    seen = set(exclude or ())
    total = 0
    for t in tensors:
        if t is None:
            continue
        key = _storage_key(t)
        if key not in seen and key[2] > 0:
            seen.add(key)
            total += key[2]
    return total


def _optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    inner = optimizer.torch_optimizer
    return [
        v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    ]


def model_state_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """{'params', 'grads', 'optimizer', 'total'}: bytes this rank holds right now.

    Call it after a step's gradients exist (before zero_grad) to see the gradient share.
    Every gradient the optimizer holds counts (ZeRO-1's buffer, ZeRO-2's shard, fp32 main
    gradients).
    """
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None] + optimizer.local_grads()
    param_keys = {_storage_key(p) for p in params}
    out = {
        "params": storage_bytes(params),
        "grads": storage_bytes(grads),
        # ZeRO-1's master weights are the model's own storage: do not count them twice.
        "optimizer": storage_bytes(_optimizer_state_tensors(optimizer), exclude=param_keys),
    }
    out["total"] = sum(out.values())
    return out


class SavedBytes:
    """Bytes of the distinct storages autograd saves while `hooks()` is entered, attributed to
    `current` (a name the caller sets; the first to save a storage owns it)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = (), current: str = "all"):
        self.current = current
        self.bytes: dict[str, int] = {}
        self._excluded = {_storage_key(t) for t in exclude}
        self._seen: set = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self._excluded and key not in self._seen:
            self._seen.add(key)
            self.bytes[self.current] = self.bytes.get(self.current, 0) + key[2]
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def saved_activation_bytes(
    fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()
) -> tuple[object, int]:
    """Run fn() and return (its result, bytes of distinct storages autograd saved for backward).

    Pass the model's parameters as `exclude`: weights saved by matmuls are not activations.
    """
    meter = SavedBytes(exclude)
    with meter.hooks():
        result = fn()
    return result, meter.total


def _by_module(model) -> SavedBytes:
    """A meter attributing saved storages to 'embedding', 'layer{i}' and 'head' by the module
    running when they were saved."""
    meter = SavedBytes(model.parameters(), current="embedding")

    def enter(name):
        def hook(*_):
            meter.current = name

        return hook

    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(enter(f"layer{i}"))
        layer.register_forward_hook(enter("head"))
    return meter


def measure(rank: int, world: int, argv: list[str]) -> dict:
    """One micro-batch's forward and backward and a plain AdamW step of the configuration
    `argv` (a `run_ranks` worker): the bytes saved per module, and the model state."""
    from megatron_ul.initialize import initialize_distributed
    from megatron_ul.optim import build_optimizer
    from megatron_ul.pipeline.schedules import micro_batch_loss_sum
    from megatron_ul.training.data import build_datasets, global_batches
    from megatron_ul.training.pretrain import build_model, configure

    cfg = configure(argv, world)
    device, dims = initialize_distributed(cfg)
    model = build_model(cfg, device, dims)
    optimizer = build_optimizer(model, cfg.train, parallel=None, dims=dims)  # plain AdamW
    train_ds, _, _ = build_datasets(cfg)
    batch = next(global_batches(cfg, dims, train_ds, device, None))[0]
    meter = _by_module(model)
    with meter.hooks():
        loss = micro_batch_loss_sum(model, batch)
    loss.backward()
    optimizer.step()
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    inner = optimizer.torch_optimizer
    state = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "saved": meter.bytes,
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "grad_bytes": sum(g.numel() * g.element_size() for g in grads),
        "optimizer_bytes": sum(t.numel() * t.element_size() for t in state),
        "params": sum(p.numel() for p in params),
    }


def measure_many(rank: int, world: int, argvs: list[list[str]]) -> list[dict]:
    """`measure` for several configurations in one set of processes."""
    return [measure(rank, world, argv) for argv in argvs]
