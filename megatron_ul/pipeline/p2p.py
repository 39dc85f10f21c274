"""Stage-to-stage point-to-point communication on the pipeline-parallel group.

Activations [N/SP, b, h] (÷TP on dim 0 under --sequence-parallel) go to the next stage and
their gradients come back to the previous one. Shapes are known from the configuration, so no
shape exchange precedes a message. The next/previous ranks wrap around the pp group, which the
interleaved schedule needs (the last stage feeds model chunk v+1 on the first stage).

Every schedule step's messages go out as ONE `batch_isend_irecv`, which is waited for before the
step's compute needs its input, as Megatron-LM's p2p_communication does. NCCL ignores tags,
completes a communicator's operations in issue order and lets a large send finish only once the
peer has posted the receive: a lone send followed by a receive deadlocks against a peer doing
the same (1F1B's steady state: stage 0 sends F(i+1) and awaits B(i) while stage 1 sends B(i)
and awaits F(i+1)). Grouped in one batch, a step's send and receive are posted together and
progress together. Within a batch the forward stream's operations come before the backward
stream's on every rank, so with two stages, where both streams share each link, the k-th send
from a rank meets the k-th receive on its peer (tests/stand_ins/nccl_p2p.py checks all of it).
The tags only label the two streams for gloo and the stand-in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..mpu.comm_stats import record
from ..mpu.parallel_state import ParallelDims

FORWARD_TAG = 1
BACKWARD_TAG = 2


class StageCommunicator:
    """Batched send/recv of activations and their gradients between adjacent pipeline stages.
    Receive buffers are allocated with `dtype`, the traffic dtype the schedule chooses."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device, dims: ParallelDims):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.group = dims.pp_group
        self.next_rank, self.prev_rank = dims.next_stage_rank, dims.prev_stage_rank

    def _outgoing(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach().to(self.dtype).contiguous()
        if tuple(tensor.shape) != self.shape:
            raise RuntimeError(
                f"pipeline send of shape {tuple(tensor.shape)}, expected {self.shape}"
            )
        record("send", tensor, self.group)
        return tensor

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def communicate(
        self,
        *,
        send_forward: torch.Tensor | None = None,
        send_backward: torch.Tensor | None = None,
        recv_forward: bool = False,
        recv_backward: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One step's messages in one batch, completed before returning: send an activation
        to the next stage and/or a gradient to the previous one; receive an activation from
        the previous stage and/or a gradient from the next. Returns (activation, gradient)
        received (None where not asked for)."""
        activation = self._buffer() if recv_forward else None
        gradient = self._buffer() if recv_backward else None
        ops = []
        if send_forward is not None:
            ops.append(
                dist.P2POp(
                    dist.isend,
                    self._outgoing(send_forward),
                    self.next_rank,
                    self.group,
                    FORWARD_TAG,
                )
            )
        if activation is not None:
            ops.append(dist.P2POp(dist.irecv, activation, self.prev_rank, self.group, FORWARD_TAG))
        if send_backward is not None:
            ops.append(
                dist.P2POp(
                    dist.isend,
                    self._outgoing(send_backward),
                    self.prev_rank,
                    self.group,
                    BACKWARD_TAG,
                )
            )
        if gradient is not None:
            ops.append(dist.P2POp(dist.irecv, gradient, self.next_rank, self.group, BACKWARD_TAG))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        return activation, gradient
