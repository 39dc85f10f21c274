"""fp32 gradients held in host memory for a model on the GPU (--optimizer-cpu-offload, plain
data parallelism), DeepSpeed ZeRO-Offload's "accumulate in CPU via GPU".

An offloaded half-precision parameter's fp32 `main_grad` is a pinned host buffer. Every
micro-batch, its gradient hook stages the sum on the device — a zero tensor for the first
micro-batch of the step, an H2D copy of the host sum after that — adds the half gradient there
(the very `main_grad.add_(grad)` an on-device main_grad does, so the bits are the same) and
copies the result back. Every copy is non-blocking on the current stream, so the host never
waits during backward, and the device keeps one parameter's fp32 staging at a time (the caching
allocator reuses it in stream order). The buffers are never zeroed on the host while a copy may
still write them: zero_grad only marks them empty (ParamState.host_grad_empty), and the first
micro-batch overwrites them.

The host reads them only after mpu/host_staging.py's `wait_for_host_copies`, the one stream
synchronisation of a step (the grad norm calls it first). Collectives never see them: every
reduction stages them through a device buffer (host_staging's `staged_flat` / `write_back`).

A run whose parameters already live on the host (a CPU run) keeps the plain on-device add.
"""

from __future__ import annotations

import torch

from ..mpu.host_staging import copied_to_host, mark_host_held
from .contract import ParamState

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


def attach_host_main_grad(p: torch.nn.Parameter, host: torch.Tensor, state: ParamState) -> None:
    """Accumulate p's gradients into the host fp32 `state.main_grad` (see the module
    docstring)."""
    mark_host_held(host, p.device)
    state.main_grad, state.host_grad_empty = host, True

    def accumulate(p: torch.Tensor) -> None:
        assert p.grad is not None and state.main_grad is not None  # autograd has just set it
        accumulate_on_host(state.main_grad, p.grad, first=state.host_grad_empty)
        state.host_grad_empty = False
        p.grad = None

    p.register_post_accumulate_grad_hook(accumulate)
