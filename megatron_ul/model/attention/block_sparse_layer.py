"""One layer's block-sparse attention: the callable DistributedAttention (ulysses.py) hands
the gathered heads to, in place of the layer's LayerAttention when --sparse-attention is given.
Without a ring it runs block_sparse.py's rectangles; with one (--context-parallel-size),
block_sparse_ring.py's."""

from __future__ import annotations

import functools
import logging
from typing import Optional

from ...config import ModelConfig
from ...mpu.parallel_state import ParallelDims
from ...sparsity_config import SparsityPattern
from .block_sparse import LayerSparsity, block_sparse_attention, unit_kernels
from .block_sparse_ring import SparseRingPlan, block_sparse_ring_attention
from .documents import DocumentMask
from .ring import Ring

log = logging.getLogger(__name__)


class SparseLayerAttention:
    """One layer's block-sparse attention on the heads the Ulysses exchange gathered (the
    callable DistributedAttention hands q, k, v to): the layout rows of this rank's global
    heads, heads [tp·H/TP + sp·H/(TP·SP), ...) of the H query heads, keyed by the run's seed
    and the layer's number. Keeps q, k, v, the output and the log-sum-exp: selective
    recompute has nothing to recompute."""

    def __init__(self, cfg: ModelConfig, dims: ParallelDims, seed: int, layer: int):
        pattern = SparsityPattern.of(cfg)
        if pattern is None:
            raise ValueError("SparseLayerAttention needs --sparse-attention")
        heads = cfg.num_attention_heads
        per_rank = heads // (dims.tp * dims.sp)
        first = dims.tp_rank * (heads // dims.tp) + dims.sp_rank * per_rank
        self.heads = range(first, first + per_rank)
        self.sparsity = LayerSparsity(pattern, heads, seed, layer)
        self.window = cfg.attention_window
        self.ring = Ring.from_dims(dims) if dims.cp > 1 else None
        self._ring_plans: dict = {}

    def __call__(self, q, k, v, *, dropout_p: float, documents: Optional[DocumentMask] = None):
        if dropout_p > 0:
            raise ValueError("block-sparse attention takes no attention dropout")
        kernels = unit_kernels(q.device, q.dtype)
        _announce(self.sparsity.pattern.mode, kernels[0].name, q.device.type)
        if self.ring is not None:
            key = (q.shape[0], k.shape[2])
            if key not in self._ring_plans:
                self._ring_plans[key] = SparseRingPlan(
                    self.sparsity.pattern, self.sparsity.num_heads, self.heads, k.shape[2],
                    q.shape[0] * self.ring.size, self.ring, self.sparsity.seed, self.sparsity.layer,
                )  # fmt: skip
            return block_sparse_ring_attention(
                q, k, v, self.ring, self._ring_plans[key], kernels,
                documents=documents, window=self.window,
            )  # fmt: skip
        plan = self.sparsity.plan(q.shape[0], self.heads, k.shape[2])
        return block_sparse_attention(
            q, k, v, plan, documents=documents, window=self.window, kernels=kernels
        )


@functools.lru_cache(maxsize=None)
def _announce(mode: str, kernel: str, device: str) -> None:
    """Logs once per process and kernel which kernel runs the rectangles."""
    log.info("attention: block-sparse %s = %s rectangles (%s)", mode, kernel, device)


__all__ = ["SparseLayerAttention"]
