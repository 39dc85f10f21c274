"""fp32 gradients held in host memory for a model on the GPU (--optimizer-cpu-offload, plain
data parallelism), DeepSpeed ZeRO-Offload's "accumulate in CPU via GPU".

An offloaded half-precision parameter's fp32 `main_grad` is a pinned host buffer. Every
micro-batch, its gradient hook stages the sum on the device — a zero tensor for the first
micro-batch of the step, an H2D copy of the host sum after that — adds the half gradient there
(the very `main_grad.add_(grad)` an on-device main_grad does, so the bits are the same) and
copies the result back. Every copy is non-blocking on the current stream, so the host never
waits during backward, and the device keeps one parameter's fp32 staging at a time (the caching
allocator reuses it in stream order). The buffers are never zeroed on the host while a copy may
still write them: zero_grad only marks them empty, and the first micro-batch overwrites them.

The host reads them only after mpu/host_staging.py's `wait_for_host_copies`, the one stream
synchronisation of a step (the grad norm calls it first). Collectives never see them: every
reduction stages them through a device buffer (host_staging's `staged_flat` / `write_back`).

A run whose parameters already live on the host (a CPU run) keeps the plain on-device add.
"""

from __future__ import annotations

import torch

from ..mpu.host_staging import copied_to_host, mark_host_held

HOST = torch.device("cpu")


def keeps_grads_apart(device: torch.device) -> bool:
    """Do parameters on `device` hold offloaded gradients apart from themselves, in host memory?
    (Not when the host is the device: a CPU run keeps the plain add.)"""
    return device != HOST


def accumulate_on_host(host: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
    """host (fp32) += grad (the model's dtype) via a transient device tensor, stream-ordered;
    `first`: host holds nothing of this step yet (its bytes are garbage, never read)."""
    if first:
        staged = torch.zeros(host.shape, dtype=torch.float32, device=grad.device)
    else:
        staged = torch.empty(host.shape, dtype=torch.float32, device=grad.device)
        staged.copy_(host, non_blocking=True)
    staged.add_(grad)  # fp32 += half: exactly an on-device main_grad's accumulation
    host.copy_(staged, non_blocking=True)
    copied_to_host(staged)


def _accumulate_hook(p: torch.Tensor) -> None:
    assert p.grad is not None  # a post-accumulate-grad hook: autograd has just set it
    accumulate_on_host(p.main_grad, p.grad, first=p.host_main_grad_empty)  # type: ignore[attr-defined]
    p.host_main_grad_empty = False  # type: ignore[attr-defined]
    p.grad = None


def attach_host_main_grad(p: torch.nn.Parameter, host: torch.Tensor) -> None:
    """Accumulate p's gradients into the host fp32 `main_grad` (see the module docstring)."""
    mark_host_held(host, p.device)
    p.main_grad = host  # type: ignore[attr-defined]
    p.host_main_grad_empty = True  # type: ignore[attr-defined]
    p.register_post_accumulate_grad_hook(_accumulate_hook)


def mark_empty(p: torch.Tensor) -> None:
    """zero_grad for a host main_grad: the next micro-batch overwrites it."""
    p.host_main_grad_empty = True  # type: ignore[attr-defined]


def settle(p: torch.Tensor) -> None:
    """Zero a host main_grad no micro-batch wrote this step (an unused parameter) before it is
    read: no copy targets it, so zeroing it on the host is safe."""
    if getattr(p, "host_main_grad_empty", False):
        p.main_grad.zero_()  # type: ignore[attr-defined]
        p.host_main_grad_empty = False  # type: ignore[attr-defined]
