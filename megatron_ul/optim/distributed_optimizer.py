"""ZeRO-1 over the DP×SP group (--use-distributed-optimizer): Adam state and the fp32 master
weights are sharded over dp_cp_sp (experts under EP > 1: over expert-DP); every rank keeps
full parameters and full gradients.

Layout. All trainable parameters are packed into one contiguous fp32 buffer, bucket after bucket
(grad_buckets.py: runs of about --ddp-bucket-size elements in model.parameters() order; a weight
tied across pipeline stages in a bucket of its own, last); the model's parameters become views
of it. Dense parameters come first; under expert parallelism the experts get buckets of their
own, after them. Each bucket is padded to a multiple of N = the size of its parameters' gradient
group (dp_cp_sp; experts under EP > 1: expert-DP, the replicas of the same experts) and that
group's rank r owns the r-th N-th of the bucket, as in Megatron's distributed optimizer, so each
bucket is one reduce-scatter and one all-gather over its group. The buffer has the model's
dtype. An fp32 model that does not offload steps the owned slices of this buffer in place: they
*are* the fp32 main copy of the shard. A --bf16/--fp16 model (or --optimizer-cpu-offload) keeps
a separate fp32 main copy of the owned slices only (in host memory when offloaded, whole
buckets, the first --optimizer-offload-fraction of them), and after the step rounds it into the
buffer, whose all-gather then moves half-precision bytes. Gradients live in a twin fp32 buffer:
an fp32 model's .grad are views of it (autograd accumulates straight into it); a half-precision
model's fp32 `main_grad` are (mixed_precision.attach_main_grad adds each micro-batch in).

Step. (1) Megatron-SP replicated weights: all-reduce over TP, as in grads.py. (2) Reduce-
scatter each bucket of the gradient buffer over dp_cp_sp with SUM (the loss is already divided by
the global token count, see training/step.py), in place: the owned slices receive the sum, the
rest of the buffer is stale until zero_grad. With --overlap-grad-reduce, (1) and (2) run per
bucket from gradient hooks while backward still runs (same collectives, same bits). (3) Global
norm from the owned slices (grads.grad_norm): sum of squares, all-reduced over dp_cp_sp, then the
model-parallel group; TP-replicated parameters count only on TP rank 0 (grads.counts_once).
(4) Clip the shard. (5) torch AdamW steps views of the owned slices, one view per (parameter ∩
owned slice), in Megatron's weight-decay groups (no decay for 1-D parameters) — element for
element the same arithmetic as the unsharded optimizer. (6) All-gather each bucket of the
parameter buffer (in place); with --overlap-param-gather asynchronously, each module waiting
for its parameters' buckets just before its next forward (or `finish_param_sync`).

Per-rank state format (state_dict(); load on the same layout and bucket size):
    {"format": "megatron_ul.zero1.v2",
     "dp_cp_sp_rank": r, "dp_cp_sp_size": N, "numel": total elements, "padded_numel": buffer size,
     "shard": [(start, end) per bucket] — this rank's elements of the flat buffer,
     "pieces": [(param name, param offset in buffer, piece start, piece end)] in the inner
               optimizer's parameter order (start/end are flat-buffer indices),
     "optimizer": torch AdamW state_dict over those pieces (exp_avg, exp_avg_sq, step)}
The main weights are saved with the model: checkpoints read each parameter's `main_shards(p)`
(its pieces of the fp32 main copy) where it has them, else the parameter itself.
Training checkpoints do not use this per-rank format: checkpoint/layout/zero.py gathers the moments
into the per-parameter form plain AdamW checkpoints use, so they load on any layout.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..model.gpt import GPTModel
from ..mpu.comm_stats import record
from ..mpu.parallel_state import ParallelDims
from ..mpu.param_spec import param_spec
from .contract import ParamStates, TrainingOptimizer
from .grad_buckets import BucketLauncher, split_into_buckets
from .grads import (
    all_reduce_coalesced,
    clip_coefficient,
    counts_once,
    grad_norm,
    reduce_group,
    sharded_like_dense,
)
from .mixed_precision import HOST, attach_main_grad, host_buffer, offloaded_prefix
from .replicated import adamw, weight_decay_groups

FORMAT = "megatron_ul.zero1.v2"


class DistributedOptimizer(TrainingOptimizer):
    """ZeRO-1: sharded Adam state and main copy, full gradients (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        train: TrainConfig,
        dims: ParallelDims,
        *,
        max_bucket_elements: int,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        tied=(),
        offload_fraction: float = 0.0,
    ):
        self.dims, self.states, self.tied = dims, ParamStates(), list(tied)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if len({p.dtype for _, p in named}) != 1:
            raise ValueError("the distributed optimizer expects one parameter dtype")
        self.half = named[0][1].dtype != torch.float32
        self.group = self.dims.dp_cp_sp_group
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        deferred_ids = {id(p) for p in self.tied}
        # One run of buckets per gradient group, dense first, as megatron-core's distributed
        # optimizer: each bucket is sharded over the group its gradients sum over (experts
        # under EP > 1: expert-DP, replicas of the same experts).
        by_group: dict[str, list[torch.nn.Parameter]] = {}
        for _, p in named:
            if id(p) not in deferred_ids:
                key = "dp_cp_sp" if sharded_like_dense(p, dims) else param_spec(p).grad_group
                by_group.setdefault(key, []).append(p)
        tied = [p for _, p in named if id(p) in deferred_ids]
        names = {id(p): n for n, p in named}
        buckets, self.bucket_groups = [], []
        for key in sorted(by_group, key=lambda k: k != "dp_cp_sp"):
            group = self.group if key == "dp_cp_sp" else reduce_group(by_group[key][0], dims)
            for bucket in split_into_buckets(by_group[key], max_bucket_elements):
                buckets.append(bucket)
                self.bucket_groups.append(group)
        if tied:
            buckets.append(tied)
            self.bucket_groups.append(self.group)
        named = [(names[id(p)], p) for bucket in buckets for p in bucket]
        self.params = [p for _, p in named]
        device = self.params[0].device
        self.numel = sum(p.numel() for p in self.params)
        # Bucket b spans [bounds[b], bounds[b] + N_b·S_b) for its group of N_b ranks; the
        # group's rank r owns its r-th S_b elements.
        self.bucket_ranges, self.shard_ranges, offset = [], [], 0
        for bucket, group in zip(buckets, self.bucket_groups):
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            per_rank = math.ceil(sum(p.numel() for p in bucket) / size)
            self.bucket_ranges.append((offset, offset + per_rank * size))
            self.shard_ranges.append((offset + rank * per_rank, offset + (rank + 1) * per_rank))
            offset += per_rank * size
        self.param_buffer = torch.zeros(offset, dtype=self.params[0].dtype, device=device)
        self.buckets = buckets
        self.deferred = frozenset([len(buckets) - 1]) if tied else frozenset()
        self._make_grad_storage(device)
        self.pieces = self._bind_params(named, buckets)
        self.main_pieces = self._main_shards(
            offloaded_prefix([hi - lo for lo, hi in self.shard_ranges], offload_fraction)
        )
        self._bind_main_shards()
        self.optimizer = self._build_inner(train)
        self._grads_in_flight: dict[int, Any] = {}  # async work handles
        sharded = self.sharded_anywhere
        self._arm_reduction(overlap_grad_reduce and sharded)
        self._params_in_flight: dict[int, Any] = {}
        self.overlap_param_gather = overlap_param_gather and sharded
        if self.overlap_param_gather:
            self._register_param_wait_hooks(model)

    def shard_group(self, p: torch.nn.Parameter):
        """The group p's state is sharded over (its bucket's: dp_cp_sp, or expert-DP)."""
        for bucket, group in zip(self.buckets, self.bucket_groups):
            if any(q is p for q in bucket):
                return group
        raise KeyError("not a parameter of this optimizer")

    @property
    def sharded_anywhere(self) -> bool:
        """Does some bucket's group hold more than this rank?"""
        return any(dist.get_world_size(g) > 1 for g in self.bucket_groups)

    # ---- where the gradients live (ZeRO-2 overrides) ---------------------------------------
    def _make_grad_storage(self, device) -> None:
        """One fp32 gradient buffer shaped like the parameter buffer."""
        self.grad_buffer = torch.zeros(
            self.param_buffer.numel(), dtype=torch.float32, device=device
        )

    def _bind_grad(self, p: torch.nn.Parameter, offset: int) -> None:
        """p's gradient is a view of the buffer: autograd (fp32) or the main-gradient hook
        (half precision) accumulates straight into it."""
        grad = self.grad_buffer[offset : offset + p.numel()].view_as(p)
        if self.half:
            attach_main_grad(p, grad, self.states[p])
        else:
            p.grad = grad

    def _owned_grad(self, lo: int, hi: int) -> torch.Tensor:
        """The reduced gradient of the owned flat range [lo, hi)."""
        return self.grad_buffer[lo:hi]

    def _arm_reduction(self, overlap: bool) -> None:
        self.launcher = BucketLauncher(
            self.buckets, self._launch_grad_reduce, overlap=overlap, deferred=self.deferred
        )

    @property
    def shards_flat_buffer(self) -> bool:
        return True

    def local_grads(self) -> list[torch.Tensor]:
        return [self.grad_buffer]

    def _bind_params(self, named, buckets) -> list[tuple]:
        """Make params views of the buffer and bind their gradients, bucket by bucket; return
        the pieces this rank owns."""
        pieces, by_id = [], {id(p): n for n, p in named}
        for bucket, (offset, _), (lo_own, hi_own) in zip(
            buckets, self.bucket_ranges, self.shard_ranges
        ):
            for p in bucket:
                n = p.numel()
                view = self.param_buffer[offset : offset + n].view_as(p)
                view.copy_(p.detach())
                p.data = view
                self._bind_grad(p, offset)
                lo, hi = max(offset, lo_own), min(offset + n, hi_own)
                if lo < hi:
                    pieces.append((by_id[id(p)], p, offset, lo, hi))
                offset += n
        return pieces

    def _main_shards(self, offloaded_buckets: int) -> list[tuple]:
        """(fp32 main copy of bucket b's owned slice, its gradient) per bucket: views of the
        buffers for an fp32 model on the device; separate fp32 tensors otherwise (on the host,
        with a host gradient, for the first `offloaded_buckets`)."""
        shards = []
        for b, (lo, hi) in enumerate(self.shard_ranges):
            own, grad = self.param_buffer[lo:hi], self._owned_grad(lo, hi)
            if b < offloaded_buckets:
                main, grad = host_buffer(own), host_buffer(own)
                main.copy_(own)
            elif self.half:
                main = own.float()
            else:
                main = own
            shards.append((main, grad))
        return shards

    @property
    def separate_main(self) -> bool:
        return any(
            main.data_ptr() != self.param_buffer[lo:hi].data_ptr()
            for (main, _), (lo, hi) in zip(self.main_pieces, self.shard_ranges)
        )

    def _main_piece(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(main copy, gradient) of the owned flat range [lo, hi)."""
        for (main, grad), (own_lo, own_hi) in zip(self.main_pieces, self.shard_ranges):
            if own_lo <= lo and hi <= own_hi:
                return main[lo - own_lo : hi - own_lo], grad[lo - own_lo : hi - own_lo]
        raise AssertionError(f"[{lo}, {hi}) is not owned by this rank")

    def _bind_main_shards(self) -> None:
        """Checkpoints read and write the main copy: each parameter's pieces of it go into the
        table as `main_shards` [(first element in the parameter, fp32 piece)]."""
        if not self.separate_main:
            return
        shards: dict[int, list] = {id(p): [] for p in self.params}
        for _, p, offset, lo, hi in self.pieces:
            shards[id(p)].append((lo - offset, self._main_piece(lo, hi)[0]))
        for p in self.params:
            self.states[p].main_shards = shards[id(p)]

    def _build_inner(self, train: TrainConfig) -> torch.optim.AdamW:
        pieces, one_d = [], set()
        for _, p, _, lo, hi in self.pieces:
            piece, grad = self._main_piece(lo, hi)
            piece.grad = grad
            pieces.append(piece)
            if p.dim() == 1:
                one_d.add(id(piece))
        groups = weight_decay_groups(pieces, train, is_1d=lambda t: id(t) in one_d)
        return adamw(groups, train, foreach=True)

    # ---- gradient reduction (steps 1-2), possibly overlapped with backward ------------------
    def start_step(self, num_micro_batches: int) -> None:
        self.launcher.start(num_micro_batches)

    def _launch_grad_reduce(self, b: int) -> None:
        sequence_parallel = [
            g
            for p in self.buckets[b]
            if param_spec(p).sequence_parallel and (g := self.grad(p)) is not None
        ]
        all_reduce_coalesced(sequence_parallel, self.dims.tp_group)
        group = self.bucket_groups[b]
        if dist.get_world_size(group) == 1:
            return
        (lo, hi), (own_lo, own_hi) = self.bucket_ranges[b], self.shard_ranges[b]
        record("reduce_scatter", self.grad_buffer[lo:hi], group)
        self._grads_in_flight[b] = dist.reduce_scatter_tensor(
            self.grad_buffer[own_lo:own_hi],
            self.grad_buffer[lo:hi],
            group=group,
            async_op=True,
        )

    def finish(self) -> None:
        """Launch the buckets backward has not, and wait for all of them."""
        self.launcher.launch_remaining()
        for b in sorted(self._grads_in_flight):
            self._grads_in_flight[b].wait()
        self._grads_in_flight.clear()

    def reduce_and_clip(self, max_norm: float) -> float:
        """Steps (1)-(4) of the module docstring; returns the norm before clipping."""
        # Before the reduce-scatter, which leaves no full gradient to sum: the tied weights
        # sit in a deferred bucket of their own (the same layout on both stages), reduced
        # only in finish, so both copies still end bitwise equal.
        self.sum_tied_grads()
        self.finish()
        norm = self._global_norm()
        coeff = clip_coefficient(norm, max_norm)
        if coeff < 1.0:
            for lo, hi in self.shard_ranges:
                self._owned_grad(lo, hi).mul_(coeff)
        return norm

    def _global_norm(self) -> float:
        # Every bucket's group lies within dp_cp_sp and its shards partition each of the
        # group's parameters: summed over dp_cp_sp, each element of every expert (one set per
        # EP rank) and of every dense parameter counts exactly once.
        owned = [
            self._owned_grad(lo, hi) for _, p, _, lo, hi in self.pieces if counts_once(p, self.dims)
        ]
        groups = (self.group, self.dims.pp_tp_group)
        return grad_norm(owned, self.param_buffer.device, groups)

    # ---- update and parameter all-gather (steps 5-6) ---------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        self.finish_param_sync()
        self._gradients_to_host()
        self.optimizer.step()
        self.copy_main_to_model()

    def _gradients_to_host(self) -> None:
        copied = False
        device = self.param_buffer.device
        for (main, grad), (lo, hi) in zip(self.main_pieces, self.shard_ranges):
            if main.device == HOST and device != HOST:
                grad.copy_(self._owned_grad(lo, hi), non_blocking=True)
                copied = True
            elif main.device == HOST:
                grad.copy_(self._owned_grad(lo, hi))
        if copied and device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # once per step: the host reads them

    @torch.no_grad()
    def copy_main_to_model(self) -> None:
        """Round the main copy into this rank's slices of the buffer and all-gather it (after
        a step or a checkpoint load)."""
        for (main, _), (lo, hi) in zip(self.main_pieces, self.shard_ranges):
            own = self.param_buffer[lo:hi]
            if main.data_ptr() != own.data_ptr():
                own.copy_(main, non_blocking=True)
        for b, ((lo, hi), (own_lo, own_hi)) in enumerate(
            zip(self.bucket_ranges, self.shard_ranges)
        ):
            group = self.bucket_groups[b]
            if dist.get_world_size(group) == 1:
                continue
            record("all_gather", self.param_buffer[lo:hi], group)
            self._params_in_flight[b] = dist.all_gather_into_tensor(
                self.param_buffer[lo:hi],
                self.param_buffer[own_lo:own_hi],
                group=group,
                async_op=True,
            )
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def finish_param_sync(self, buckets: list[int] | None = None) -> None:
        """Wait for the parameter all-gathers of `buckets` (default: all) still in flight.
        Anything that reads the parameters outside a forward pass calls this first."""
        for b in sorted(self._params_in_flight) if buckets is None else buckets:
            handle = self._params_in_flight.pop(b, None)
            if handle is not None:
                handle.wait()

    def _register_param_wait_hooks(self, model: torch.nn.Module) -> None:
        """Before a module's forward, wait for the buckets holding its own parameters; and
        before the output layer reads a tied embedding table, for the table's bucket (on the
        last pipeline stage the embedding's own forward, and so its hook, never runs)."""
        bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        for module in model.modules():
            own = {bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of}
            if own:
                buckets = sorted(own)
                module.register_forward_pre_hook(
                    lambda _m, _args, buckets=buckets: self.finish_param_sync(buckets)
                )
            if isinstance(module, GPTModel):
                tied = module.tied_output_weight
                if tied is not None and id(tied) in bucket_of:
                    wait = partial(self.finish_param_sync, [bucket_of[id(tied)]])
                    module.register_tied_weight_read_hook(wait)

    def zero_grad(self) -> None:
        """Zero in place: the parameters' .grad must stay views of the gradient buffer."""
        self.grad_buffer.zero_()

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "format": FORMAT,
            "dp_cp_sp_rank": self.rank,
            "dp_cp_sp_size": self.size,
            "numel": self.numel,
            "padded_numel": self.param_buffer.numel(),
            "shard": [tuple(r) for r in self.shard_ranges],
            "pieces": [(name, offset, lo, hi) for name, _, offset, lo, hi in self.pieces],
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("format", "dp_cp_sp_rank", "dp_cp_sp_size", "numel", "shard", "pieces"):
            if _as_lists(state.get(key)) != _as_lists(mine[key]):
                raise ValueError(
                    f"distributed-optimizer checkpoint does not match this run "
                    f"({key}: saved {state.get(key)!r}, now {mine[key]!r}); load it "
                    f"with the same model and the same DP×SP size"
                )
        self.optimizer.load_state_dict(state["optimizer"])


def _as_lists(value):
    """Tuples and lists compare alike (a saved state may have turned one into the other)."""
    if isinstance(value, (list, tuple)):
        return [_as_lists(v) for v in value]
    return value
