"""fp16 loss scaling (Megatron's ConstantGradScaler / DynamicGradScaler semantics).

fp16 runs hold an fp16 model with fp32 main parameters, gradients and Adam state
(mixed_precision.py); the loss is multiplied by the scale before backward so small gradients
survive fp16, and the fp32 (main) gradients are multiplied by 1/scale (a power of two: exact)
before they are reduced,
clipped and applied. A step whose gradients hold inf/nan on ANY rank is skipped on every rank
and logged; the dynamic scale then backs off.

Dynamic rule (Megatron): on overflow, reset the growth counter and decrement the hysteresis
counter; when that reaches 0, scale = max(scale · 0.5, --min-loss-scale). After
--loss-scale-window consecutive good steps, scale ·= 2 and the hysteresis counter refills to
--hysteresis.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..config import TrainConfig
from ..mpu.host_staging import wait_for_host_copies

log = logging.getLogger("megatron_ul")


class GradScaler:
    """--loss-scale S gives a constant scale; otherwise the scale is dynamic."""

    def __init__(
        self,
        initial_scale: float,
        *,
        dynamic: bool = True,
        min_scale: float = 1.0,
        window: int = 1000,
        hysteresis: int = 2,
    ):
        self.scale, self.dynamic, self.min_scale = float(initial_scale), dynamic, min_scale
        self.window, self.hysteresis = window, hysteresis
        self._growth_tracker, self._hysteresis_tracker = 0, hysteresis
        self.last_step_skipped, self.skipped_steps = False, 0

    def update(self, found_inf: bool) -> None:
        self.last_step_skipped = found_inf
        self.skipped_steps += int(found_inf)
        if not self.dynamic:
            return
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.window:
            self._growth_tracker, self._hysteresis_tracker = 0, self.hysteresis
            self.scale *= 2.0

    @torch.no_grad()
    def unscale_and_check(
        self, grads: list[torch.Tensor], device: torch.device, iteration: int = 0
    ) -> bool:
        """Multiply this rank's gradients (the optimizer's local_grads) by 1/scale; True if
        every rank's are finite. Updates the scale and logs a skipped step. `device`: the
        training device (NCCL has no CPU tensors, and one host sync is enough)."""
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        found = torch.zeros((), dtype=torch.float32, device=device)
        wait_for_host_copies()  # host-held gradients are read (and scaled) on the host
        for g in grads:
            g.mul_(1.0 / self.scale)
            overflow = (~torch.isfinite(g)).any().float()
            found = torch.maximum(found, overflow.to(found.device, non_blocking=True))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)  # skip everywhere or nowhere
        found_inf = bool(found.item())
        before = self.scale
        self.update(found_inf)
        if found_inf:
            log.warning(
                "iteration %d: fp16 gradients contain inf/nan at loss scale %g; "
                "skipping this step (loss scale now %g, %d skipped so far)",
                iteration,
                before,
                self.scale,
                self.skipped_steps,
            )
        return not found_inf

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._growth_tracker = state["growth_tracker"]
        self._hysteresis_tracker = state["hysteresis_tracker"]
        self.skipped_steps = state["skipped_steps"]


def build_grad_scaler(train: TrainConfig) -> GradScaler | None:
    """A scaler for --fp16, None otherwise (bf16 and fp32 need no loss scaling)."""
    if not train.fp16:
        return None
    if train.loss_scale is not None:
        return GradScaler(train.loss_scale, dynamic=False)
    return GradScaler(
        train.initial_loss_scale,
        min_scale=train.min_loss_scale,
        window=train.loss_scale_window,
        hysteresis=train.hysteresis,
    )
