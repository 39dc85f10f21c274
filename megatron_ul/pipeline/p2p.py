"""Stage-to-stage point-to-point communication on the pipeline-parallel group.

Activations [N/SP, b, h] (÷TP on dim 0 under --sequence-parallel) go to the next stage and
their gradients come back to the previous one. Shapes are known from the configuration, so no
shape exchange precedes a message. Sends are asynchronous (isend) and kept alive until
`wait_sends()`; receives block until the data is there. The next/previous ranks wrap around
the pp group, which the interleaved schedule needs (the last stage feeds model chunk v+1 on
the first stage). Forward activations and backward gradients use different tags, so that with
two stages the two streams that share the 0 -> 1 link never get mixed up.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..mpu.parallel_state import ParallelDims
from ..mpu.comm_stats import record

FORWARD_TAG = 1
BACKWARD_TAG = 2


class StageCommunicator:
    """send/recv of activations and their gradients between adjacent pipeline stages."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device, dims: ParallelDims):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.group = dims.pp_group
        self.next_rank, self.prev_rank = dims.next_stage_rank, dims.prev_stage_rank
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().to(self.dtype).contiguous()
        if tuple(tensor.shape) != self.shape:
            raise RuntimeError(f"pipeline send of shape {tuple(tensor.shape)}, expected "
                               f"{self.shape}")
        record("send", tensor, self.group)
        work = dist.isend(tensor, dst, group=self.group, tag=tag)
        assert work is not None, "isend on a pipeline group this rank is not part of"
        self._pending.append((work, tensor))

    def _recv(self, src: int, tag: int) -> torch.Tensor:
        tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.recv(tensor, src, group=self.group, tag=tag)
        return tensor

    def send_forward(self, activation: torch.Tensor) -> None:
        self._send(activation, self.next_rank, FORWARD_TAG)

    def recv_forward(self) -> torch.Tensor:
        return self._recv(self.prev_rank, FORWARD_TAG)

    def send_backward(self, grad: torch.Tensor) -> None:
        self._send(grad, self.prev_rank, BACKWARD_TAG)

    def recv_backward(self) -> torch.Tensor:
        return self._recv(self.next_rank, BACKWARD_TAG)

    def wait_sends(self) -> None:
        """Block until every send issued so far has been delivered."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
