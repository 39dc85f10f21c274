"""fp32 main parameters for a half-precision model, and the optimizer step in host memory.

Megatron-LM's Float16OptimizerWithFloat16Params with --accumulate-allreduce-grads-in-fp32, and
megatron-core's --optimizer-cpu-offload:
- A --bf16/--fp16 model holds its parameters in half precision. Each one gets an fp32
  `main_grad`; a post-accumulate-grad hook adds every micro-batch's half-precision gradient into
  it and drops the half one, so gradients accumulate, are reduced over dp_cp_sp and clipped in
  fp32 (the optimizer's ParamStates table holds it; `grad(p)` hands it out).
- AdamW steps fp32 main copies (the optimizer's `main_param`); the updated main copy is
  then rounded into the model's parameter. Checkpoints read and write the main copies
  (checkpoint/state.py), so the saved weights and Adam state are fp32 whatever the model's
  dtype.
- --optimizer-cpu-offload puts the main copies of the first --optimizer-offload-fraction of the
  parameters (counted in elements, in model.parameters() order), and so their Adam state, in
  host memory (pinned when a GPU trains): AdamW steps on the host, the new weights go up, each
  copy non-blocking. A half-precision model's offloaded parameters also hold their fp32
  main_grad on the host, accumulated micro-batch by micro-batch through the device
  (host_grads.py); an fp32 model's gradients go down once per step. On a CPU run the host *is*
  the device: the step is the same arithmetic on the same values, bit for bit.
An fp32 model that offloads nothing keeps torch's AdamW on the parameters themselves.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TrainConfig
from ..mpu import host_staging
from . import host_grads
from .contract import ParamState
from .host_grads import HOST
from .replicated import ReplicatedOptimizer, adamw


def half_dtype(train: TrainConfig):
    """The model's parameter dtype under --bf16 / --fp16, None for fp32."""
    return torch.bfloat16 if train.bf16 else torch.float16 if train.fp16 else None


def attach_main_grad(p: nn.Parameter, main_grad: torch.Tensor, state: ParamState) -> None:
    """Accumulate p's gradients into the fp32 `state.main_grad` (registered before any other
    gradient hook, so the reduction hooks of grad_buckets.py see the accumulated sum)."""
    state.main_grad = main_grad

    def accumulate(p: torch.Tensor) -> None:
        assert state.main_grad is not None and p.grad is not None
        state.main_grad.add_(p.grad)  # fp32 += half: accumulates in fp32
        p.grad = None

    p.register_post_accumulate_grad_hook(accumulate)


def offloaded_prefix(sizes: list[int], fraction: float) -> int:
    """How many of the leading items (of `sizes` elements each) the offload takes: as many as
    keep the offloaded elements within fraction · total (fraction 1: all)."""
    total, taken, count = sum(sizes), 0, 0
    for n in sizes:
        if taken + n > fraction * total:
            break
        taken, count = taken + n, count + 1
    return count


def host_buffer(like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """An empty host tensor shaped like `like`; pinned when `like` lives on a GPU, so copies
    to and from it can run asynchronously."""
    return torch.empty(like.shape, dtype=dtype, device=HOST, pin_memory=like.device.type == "cuda")


def main_copy(p: nn.Parameter, device) -> nn.Parameter:
    """An fp32 copy of p on `device` carrying p's attributes (TP layout, names' markers)."""
    data = (
        host_buffer(p)
        if device == HOST
        else torch.empty(p.shape, dtype=torch.float32, device=p.device)
    )
    data.copy_(p.detach())
    main = nn.Parameter(data)
    for key, value in vars(p).items():
        if not key.startswith("_"):
            setattr(main, key, value)
    return main


class MainParamOptimizer(ReplicatedOptimizer):
    """AdamW over fp32 main copies of the model's parameters (replicated data parallelism;
    ZeRO keeps its own main shards in distributed_optimizer.py)."""

    def __init__(self, *args, offload_fraction: float, **kwargs):
        self.offload_fraction = offload_fraction
        super().__init__(*args, **kwargs)

    def _build_inner(self, model, train: TrainConfig, groups: list[dict], fused: bool):
        params = [p for g in groups for p in g["params"]]
        half = params[0].dtype != torch.float32
        order = [p for p in model.parameters() if p.requires_grad]
        taken = offloaded_prefix([p.numel() for p in order], self.offload_fraction)
        host = {id(p) for p in order[:taken]}
        self.pairs = []
        for p in params:
            device = HOST if id(p) in host else p.device
            main = main_copy(p, device) if half or device == HOST else p
            state = self.states[p]
            if main is not p:
                state.main_param = main
            if half and device == HOST and host_grads.keeps_grads_apart(p.device):
                host_grads.attach_host_main_grad(p, host_buffer(p), state)
            elif half:
                attach_main_grad(p, torch.zeros_like(p, dtype=torch.float32), state)
            self.pairs.append((p, main))
        main_of = {id(p): m for p, m in self.pairs}
        main_groups = [{**g, "params": [main_of[id(p)] for p in g["params"]]} for g in groups]
        self.offloaded_elements = sum(p.numel() for p in params if id(p) in host)
        # fused needs every tensor on the GPU; foreach groups them by device.
        return adamw(
            main_groups, train, **({"fused": True} if fused and not host else {"foreach": True})
        )

    @torch.no_grad()
    def step(self) -> None:
        for p, main in self.pairs:
            grad = self.grad(p)
            if main is p or grad is None:
                continue
            if main.device == grad.device:
                main.grad = grad  # the fp32 main_grad itself: no copy
            else:  # an fp32 model's gradient goes down to the host main copy
                if main.grad is None:
                    main.grad = host_buffer(main)
                main.grad.copy_(grad, non_blocking=True)
                host_staging.copied_to_host(grad)
        host_staging.wait_for_host_copies()  # at most once per step: the host reads them now
        self.optimizer.step()
        self.copy_main_to_model()

    @torch.no_grad()
    def copy_main_to_model(self) -> None:
        """Round the fp32 main copies into the model's parameters (after a step or a load)."""
        for p, main in self.pairs:
            if main is not p:
                p.copy_(main, non_blocking=True)

    def zero_grad(self) -> None:
        for p, _ in self.pairs:
            state = self.states[p]
            if state.main_grad is not None and host_staging.is_host_held(state.main_grad):
                state.host_grad_empty = True  # overwritten next: no host memset racing a copy
            elif state.main_grad is not None:
                state.main_grad.zero_()  # persistent: the accumulation hooks add into it
            p.grad = None
