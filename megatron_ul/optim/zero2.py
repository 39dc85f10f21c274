"""ZeRO-2 over the DP×SP group (--zero-stage 2): Adam state, the fp32 main copy and the
gradients are sharded over each parameter's gradient group (dp_cp_sp; experts under EP > 1:
expert-DP); the parameters stay replicated.

Everything but the gradients is ZeRO-1's (distributed_optimizer.py): the same flat parameter
buffer, buckets, owned slices, inner AdamW, norm and parameter all-gather. The difference is
where gradients live. ZeRO-1 keeps a full-size fp32 gradient buffer for the whole step; here
each rank keeps only the fp32 gradient of its owned slices (`grad_shard`, 1/N of the buffer).

Reduction. Autograd leaves each micro-batch's gradient in p.grad (the model's dtype). A
post-accumulate-grad hook counts them per bucket; when every parameter of a bucket has its
gradient of this micro-batch (ZeRO-1 waits for the last micro-batch), the bucket is copied into
one transient fp32 flat tensor, the p.grad are dropped, Megatron-SP replicated weights' parts
are summed over TP, and the flat tensor is reduce-scattered (SUM) over dp_cp_sp; the owned part
is added into `grad_shard`. So a bucket's full gradient lives from its last gradient to the end
of its collective, and half-precision gradients accumulate over micro-batches in fp32 (in the
shard). Without --overlap-grad-reduce each collective is waited for at once; with it, up to
`IN_FLIGHT` buckets are in flight, retired in launch order (the same additions in the same
order either way: bit-identical). A parameter left without gradient in some micro-batch only
delays its bucket's launch (the sum is linear); whatever is left at the end is launched by
`finish`, like the bucket of weights tied across pipeline stages, which is first summed over
the embedding group (a half-precision model accumulates that one bucket in an fp32 main_grad).

Against ZeRO-1 the sum over ranks happens per micro-batch, before the sum over micro-batches:
the same terms in another order, equal to fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..mpu.comm_stats import record
from ..mpu.param_spec import param_spec
from .distributed_optimizer import DistributedOptimizer
from .grads import all_reduce_coalesced
from .mixed_precision import attach_main_grad

IN_FLIGHT = 2  # reduce-scatters (and their flat inputs) alive at once with overlap


class Zero2Optimizer(DistributedOptimizer):
    """ZeRO-1 with the gradients sharded too (see the module docstring)."""

    def _make_grad_storage(self, device) -> None:
        sizes = [hi - lo for lo, hi in self.shard_ranges]
        self.grad_shard = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        self._shard_start = {}  # owned flat start -> its offset in grad_shard
        offset = 0
        for (lo, _), n in zip(self.shard_ranges, sizes):
            self._shard_start[lo] = offset
            offset += n

    def _owned_grad(self, lo: int, hi: int) -> torch.Tensor:
        for own_lo, own_hi in self.shard_ranges:
            if own_lo <= lo and hi <= own_hi:
                start = self._shard_start[own_lo] + lo - own_lo
                return self.grad_shard[start : start + hi - lo]
        raise AssertionError(f"[{lo}, {hi}) is not owned by this rank")

    def _bind_grad(self, p: torch.nn.Parameter, offset: int) -> None:
        del offset
        if self.half and any(p is t for t in self.tied):  # summed over stages first, in fp32
            attach_main_grad(p, torch.zeros_like(p, dtype=torch.float32), self.states[p])

    def _arm_reduction(self, overlap: bool) -> None:
        self.overlap = overlap
        self.armed = False
        self.counts = [0] * len(self.buckets)
        self._in_flight: list[tuple] = []  # (bucket, flat input, owned output, work)
        for b, bucket in enumerate(self.buckets):
            if b in self.deferred:
                continue
            for p in bucket:
                p.register_post_accumulate_grad_hook(lambda _p, b=b: self._accumulated(b))

    def start_step(self, num_micro_batches: int) -> None:
        del num_micro_batches  # every micro-batch's complete bucket is reduced
        self.armed = True
        self.counts = [0] * len(self.buckets)

    def _accumulated(self, b: int) -> None:
        if not self.armed:
            return
        self.counts[b] += 1
        if self.counts[b] % len(self.buckets[b]) == 0:
            self._reduce_bucket(b)

    @torch.no_grad()
    def _reduce_bucket(self, b: int) -> None:
        (lo, hi), (own_lo, own_hi) = self.bucket_ranges[b], self.shard_ranges[b]
        flat = torch.zeros(hi - lo, dtype=torch.float32, device=self.param_buffer.device)
        offset, sequence_parallel = 0, []
        for p in self.buckets[b]:
            n = p.numel()
            grad = self.grad(p)
            if grad is not None:
                flat[offset : offset + n].copy_(grad.reshape(-1))
                if param_spec(p).sequence_parallel:
                    sequence_parallel.append(flat[offset : offset + n])
            p.grad = None
            offset += n
        all_reduce_coalesced(sequence_parallel, self.dims.tp_group)
        owned = self._owned_grad(own_lo, own_hi)
        group = self.bucket_groups[b]
        if dist.get_world_size(group) == 1:
            owned.add_(flat)
            return
        out = torch.empty_like(owned)
        record("reduce_scatter", flat, group)
        work = dist.reduce_scatter_tensor(out, flat, group=group, async_op=True)
        self._in_flight.append((owned, out, flat, work))
        while len(self._in_flight) > (IN_FLIGHT if self.overlap else 0):
            self._retire()

    def _retire(self) -> None:
        owned, out, _flat, work = self._in_flight.pop(0)
        work.wait()
        owned.add_(out)

    def finish(self) -> None:
        """Reduce what the hooks have not (the tied bucket, buckets with a parameter that
        took no gradient) and wait for every collective."""
        for b, bucket in enumerate(self.buckets):
            if b in self.deferred or self.counts[b] % len(bucket) != 0:
                self._reduce_bucket(b)
        while self._in_flight:
            self._retire()
        self.armed = False
        self.counts = [0] * len(self.buckets)

    def local_grads(self) -> list[torch.Tensor]:
        while self._in_flight:  # the scaler reads the shard
            self._retire()
        held = [self.grad(p) for p in self.params]
        return [self.grad_shard] + [g for g in held if g is not None]

    def zero_grad(self) -> None:
        self.grad_shard.zero_()
        for p in self.params:
            state = self.states.get(p)
            if state is not None and state.main_grad is not None:
                state.main_grad.zero_()
            p.grad = None
