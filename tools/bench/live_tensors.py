"""Live-tensor tracker: the bytes of every tensor storage alive, op by op, and what was alive
at the peak.

A TorchDispatchMode sees every tensor an op returns, below autograd, so it also sees the
tensors autograd saves, the gradients backward makes and the optimizer's state. Each new
storage is labelled when it first appears with the phase, the module that was running
(forward and recompute) or the autograd node (backward), and the op; it counts until the last
tensor on it dies (a weakref finalizer per tensor; torch keeps a tensor's Python object alive
while C++ holds it, so a tensor only autograd still saves stays counted). What an op
allocates and frees inside one kernel call is invisible here: peak RSS (see `peak_rss_bytes`)
bounds it.

    with LiveTensorTracker(model) as tracker:
        tracker.phase = "iteration 1 forward-backward"
        ...
    tracker.peaks[phase].bytes, .where, tracker.peak_breakdown(phase)

Peaks are kept per phase (the caller names phases), so the peak of the layers' backward is
not hidden behind a larger one in the optimizer step.

Device only: what a GPU run keeps in host memory (offloaded activations, host-held optimizer
state) is handed to `hold_on_host` and counted apart (`host_bytes`) from then on, so the peaks
and their breakdowns are the device's; `total_peaks` keeps the peaks of both together.
"""

from __future__ import annotations

import resource
import weakref
from collections import defaultdict

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

# A new peak is photographed (every live storage and its label) only when it beats the last
# photographed one by this fraction: the exact peak is always kept, the breakdown is within it.
SNAPSHOT_STEP = 0.002
_FINALIZERS = "_live_tensor_finalizers"


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Peak:
    """The largest live total seen in one phase, where it happened, and what was alive."""

    def __init__(self):
        self.bytes, self.where = 0, ""
        self.snapshot: list = []
        self.snapshot_bytes = 0

    def update(self, live: int, where, storages, classify) -> None:
        """storages() -> {key: entry} of what is alive (called only to photograph)."""
        if live <= self.bytes:
            return
        self.bytes, self.where = live, where()
        if live > self.snapshot_bytes * (1 + SNAPSHOT_STEP):
            classes = _class_of_keys(classify())
            self.snapshot = [(key, e[0], classes.get(key, e[2])) for key, e in storages().items()]
            self.snapshot_bytes = live


def _class_of_keys(classes: dict) -> dict:
    by_key: dict = {}
    for name, tensors in classes.items():
        for t in tensors:
            key, _ = _storage_key(t)
            if key is not None:
                by_key.setdefault(key, name)
    return by_key


def _storage_key(t: torch.Tensor):
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse or otherwise storage-less
        return None, 0
    return (t.device.type, storage.data_ptr()), storage.nbytes()


class LiveTensorTracker(TorchDispatchMode):
    """Counts live storage bytes; `phase` is set by the caller ('iteration 2', 'optimizer')."""

    def __init__(self, model: torch.nn.Module | None = None, preexisting=(), classify=dict):
        """classify() -> {name: tensors}: called when a peak is photographed; storages of those
        tensors are reported under that name ('gradients', ...) instead of the op's label."""
        super().__init__()
        self._classify = classify
        self.phase = "setup"
        self._names = {m: n for n, m in model.named_modules()} if model is not None else {}
        self._module_stack: list[str] = []
        self._storages: dict = {}  # key -> [bytes, live tensor count, label, on host]
        self.live_bytes = 0  # on the device
        self.host_bytes = 0
        self.peaks: dict[str, Peak] = defaultdict(Peak)
        self.total_peaks: dict[str, int] = defaultdict(int)  # device + host
        self._hooks: list = []
        for t in preexisting:
            self._register(t, "preexisting")

    # ---- context -----------------------------------------------------------------------------
    def __enter__(self):
        self._hooks = [
            register_module_forward_pre_hook(self._enter_module),
            register_module_forward_hook(self._leave_module),
        ]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)

    def _enter_module(self, module, _inputs):
        if module in self._names:
            self._module_stack.append(self._names[module])

    def _leave_module(self, module, _inputs, _output):
        # Pop down to this module: a forward stopped early (torch's checkpoint ends its
        # recompute by raising) never called its leave hooks.
        name = self._names.get(module)
        if name in self._module_stack:
            while self._module_stack.pop() != name:
                pass

    # ---- counting ----------------------------------------------------------------------------
    def _label(self, func) -> str:
        node = torch._C._current_autograd_node()
        if node is not None:
            return f"{self.phase} backward | {type(node).__name__} | {func.__name__}"
        where = self._module_stack[-1] if self._module_stack else "-"
        return f"{self.phase} | {where} | {func.__name__}"

    def _register(self, t: torch.Tensor, label: str) -> None:
        key, nbytes = _storage_key(t)
        if key is None or nbytes == 0:
            return
        entry = self._storages.get(key)
        if entry is None:
            entry = self._storages[key] = [nbytes, 0, label, False]
            self.live_bytes += nbytes
        entry[1] += 1
        finalizer = weakref.finalize(t, self._release, key)
        # a tensor emptied in place by set_() lets go of its storage while its Python object
        # lives on: its finalizers run then (see __torch_dispatch__)
        t.__dict__.setdefault(_FINALIZERS, []).append(finalizer)

    def _release(self, key) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            if entry[3]:
                self.host_bytes -= entry[0]
            else:
                self.live_bytes -= entry[0]
            del self._storages[key]

    def hold_on_host(self, tensors) -> None:
        """The storages of `tensors` are in host memory on a GPU run: counted apart from the
        device's from now until they die."""
        for t in tensors:
            key, _ = _storage_key(t)
            entry = self._storages.get(key) if key is not None else None
            if entry is not None and not entry[3]:
                entry[3] = True
                self.live_bytes -= entry[0]
                self.host_bytes += entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.set_.default and len(args) == 1:  # emptied
            for finalizer in args[0].__dict__.pop(_FINALIZERS, ()):
                finalizer()
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        label = None
        for t in outputs:
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                label = label or self._label(func)
                self._register(t, label)
        self.peaks[self.phase].update(
            self.live_bytes, lambda: self._label(func), self._device_storages, self._classify
        )
        total = self.live_bytes + self.host_bytes
        if total > self.total_peaks[self.phase]:
            self.total_peaks[self.phase] = total
        return out

    def _device_storages(self) -> dict:
        return {key: e for key, e in self._storages.items() if not e[3]}

    # ---- results -----------------------------------------------------------------------------
    def peak(self, phase: str | None = None) -> tuple[str, Peak]:
        """(phase, its Peak); the largest over all phases when phase is None."""
        if phase is None:
            phase = max(self.peaks, key=lambda p: self.peaks[p].bytes)
        return phase, self.peaks[phase]

    def peak_breakdown(
        self, phase: str | None = None, classes: dict | None = None
    ) -> dict[str, int]:
        """{label: bytes} of the storages alive at the (photographed) peak of `phase` (the
        largest phase when None). `classes` maps a name ('parameters', 'optimizer state') to
        tensors whose storages are reported under that name instead of the op that made
        them (as `classify` does at the time of the peak)."""
        by_key = _class_of_keys(classes or {})
        totals: dict[str, int] = defaultdict(int)
        for key, nbytes, label in self.peak(phase)[1].snapshot:
            totals[by_key.get(key, label)] += nbytes
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))
