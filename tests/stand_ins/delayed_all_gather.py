"""A stand-in for NCCL's asynchronous all-gather, for CPU tests: the gathered values reach the
output only when the work handle is waited on.

On NCCL an `async_op=True` collective runs on the communicator's own CUDA stream, and
`work.wait()` only makes the current stream wait for it (torch/csrc/distributed/c10d/
ProcessGroupNCCL.cpp, `WorkNCCL::wait` -> `WorkNCCL::synchronizeStream`: "Block the current
stream on the NCCL stream", an event block, no host wait). A kernel queued on the compute stream
before that wait may read the output before the gather has written it: the values of the
previous step. gloo finishes a small gather before anyone reads it, so such a read passes on
CPU. Here `all_gather_into_tensor(..., async_op=True)` runs the real collective into a buffer
of its own at once (every rank still calls it in the same order) and leaves the output as it
was until `wait()`, when the gathered values are written: a read before the wait sees the old
values, always. The input is read at the call, as NCCL reads it in stream order.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist


class _Delayed:
    def __init__(self, output: torch.Tensor, gathered: torch.Tensor):
        self.output, self.gathered, self.done = output, gathered, False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            self.output.copy_(self.gathered)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


@contextmanager
def delayed_all_gathers():
    real = dist.all_gather_into_tensor

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        if not async_op:
            return real(output, input, group=group)
        gathered = torch.empty_like(output)
        real(gathered, input, group=group)
        return _Delayed(output, gathered)

    dist.all_gather_into_tensor = all_gather_into_tensor
    try:
        yield
    finally:
        dist.all_gather_into_tensor = real
