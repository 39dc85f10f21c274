"""Gradient buckets and the hooks that launch their reduction while backward still runs
(--overlap-grad-reduce, Megatron's distributed data parallel).

Parameters are grouped into buckets of about --ddp-bucket-size elements. Whether or not the
reduction overlaps backward, the buckets — and so the collectives and the order in which each
element is summed — are the same: the overlapped result is bit-identical to the plain one; only
the moment each bucket's collective starts differs.

Overlap. A post-accumulate-grad hook on every parameter counts the gradients accumulated into
it during the step; when every parameter of a bucket has received its gradient of the *last*
micro-batch (a count of len(bucket) · micro-batches), the bucket's collective is launched
asynchronously. Gradient accumulation and pipeline schedules (1F1B, interleaved) therefore need
no "no_sync" context: earlier micro-batches never complete a bucket. Every rank of the group
runs the same autograd graph, so buckets complete in the same order everywhere, as the
collectives require.

Deferred buckets hold a weight tied across pipeline stages (the word embedding on the first and
last stage): its gradient must first be summed over the embedding group, after backward, so
these buckets are launched by `finish` only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DEFAULT_BUCKET_ELEMENTS = 40_000_000  # Megatron's default with --overlap-grad-reduce


def bucket_elements(ddp_bucket_size: int | None, dp_cp_sp_size: int) -> int:
    """--ddp-bucket-size, or Megatron's default max(40M, 1M · data-parallel size)."""
    if ddp_bucket_size is not None:
        return ddp_bucket_size
    return max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * dp_cp_sp_size)


def split_into_buckets(
    params: list[torch.nn.Parameter], max_elements: int
) -> list[list[torch.nn.Parameter]]:
    """Consecutive runs of `params` of at most max_elements (a larger parameter is a bucket of
    its own)."""
    buckets: list[list[torch.nn.Parameter]] = [[]]
    filled = 0
    for p in params:
        if buckets[-1] and filled + p.numel() > max_elements:
            buckets.append([])
            filled = 0
        buckets[-1].append(p)
        filled += p.numel()
    return [b for b in buckets if b]


class BucketLauncher:
    """Calls launch(i) for bucket i once per step: from the gradient hooks when overlapping
    (as soon as its last gradient is in), else (and for whatever the hooks did not launch)
    from `launch_remaining`."""

    def __init__(
        self,
        buckets: list[list[torch.nn.Parameter]],
        launch: Callable[[int], None],
        overlap: bool,
        deferred: frozenset[int] = frozenset(),
    ):
        self.buckets, self.launch, self.overlap = buckets, launch, overlap
        self.deferred = deferred
        self.launched = [False] * len(buckets)
        self.counts = [0] * len(buckets)
        self.expected: int | None = None  # micro-batches of the current step
        self.launched_by_hooks = 0  # in the last step (logs and tests)
        self.hooks = []
        if overlap:
            for i, bucket in enumerate(buckets):
                if i in deferred:
                    continue
                for p in bucket:
                    self.hooks.append(
                        p.register_post_accumulate_grad_hook(lambda _p, i=i: self._accumulated(i))
                    )

    def start(self, num_micro_batches: int) -> None:
        """Arm the hooks for a step of `num_micro_batches` backward passes."""
        self.expected = num_micro_batches
        self.launched_by_hooks = 0
        self.counts = [0] * len(self.buckets)
        self.launched = [False] * len(self.buckets)

    def _accumulated(self, i: int) -> None:
        if self.expected is None or self.launched[i]:
            return
        self.counts[i] += 1
        if self.counts[i] == len(self.buckets[i]) * self.expected:
            self.launched[i] = True
            self.launched_by_hooks += 1
            self.launch(i)

    def launch_remaining(self) -> None:
        """Launch, in bucket order, every bucket the hooks have not; disarm the hooks."""
        for i in range(len(self.buckets)):
            if not self.launched[i]:
                self.launched[i] = True
                self.launch(i)
        self.expected = None

    def remove_hooks(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
