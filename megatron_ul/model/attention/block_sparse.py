"""Block-sparse attention: a layout's blocks run as rectangles of the blocked engine.

A head's layout (block_sparse_layouts.py), less the blocks causality hides, is cut into
rectangles of (query rows, key columns), in block units:
  * diagonal squares [a, b) x [a, b) whose lower triangle the layout holds entirely: one call
    with the kernel's own causal flag (a Fixed local window, a sliding window's pair);
  * the rest, row by row, into runs of consecutive key blocks; a run that the next rows repeat
    exactly (a global column, a window of leading blocks) grows downwards into one call.
Each rectangle is one unit-kernel call (lse_kernels: forward returns the log-sum-exp), merged
into an fp32 (fp64 for fp64) output by the log-sum-exp rule; backward is FlashAttention's:
with the final output and log-sum-exp a rectangle's probabilities are exp(S - lse), so each
call adds its share of dq, dk, dv. Memory: q, k, v, the output and the log-sum-exp, plus one
call's scores inside its kernel; time: the computed blocks. No [N, N] tensor exists.

Documents (--reset-attention-mask) and the window (--window-size) combine with the layout
(a token sees a key only where all three allow it): a rectangle no query of which shares a
document with, or comes within the window of, any of its keys is skipped, decided on the host
from the documents' offsets; one they cut through runs with an additive mask built from token
positions, in tiles of MASK_TILE_ROWS query rows so that no mask is quadratic.

Heads: the layout rows of this rank's GLOBAL heads (`heads`: Ulysses gives a rank heads
[r·h, (r+1)·h) of its TP slice). Where every head shares one layout, one call covers all of
them (GQA inside the kernel); per-head layouts run per query head with its kv head.

On CUDA the rectangles run on torch's memory-efficient kernel (masked or not; fp64: the
softmax written out), the ring's kernels: FlexAttention would need torch.compile and a block
mask per shape and per micro-batch's documents, where these calls take documents, windows and
any layout as they are, with the same kernels the ring and the document tiles use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from . import lse_kernels
from .block_sparse_layouts import block_layout
from .documents import DocumentMask
from .lse_kernels import UnitKernel
from ...sparsity_config import SparsityPattern

MASK_TILE_ROWS = 512  # query rows per masked call: its mask is [b, 1, rows, keys]


@dataclass(frozen=True)
class Rect:
    """Query rows [q0, q1) against keys [k0, k1), in tokens; `causal`: a diagonal square."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def rectangles(layout: np.ndarray, block: int, diagonal: bool = True) -> list[Rect]:
    """The rectangles that cover a head's layout [rows, columns] (bool, host) at or below the
    diagonal, each block once. `diagonal` False: a piece of the layout wholly below the
    diagonal (a ring unit of earlier keys), every block of it visible."""
    nb = layout.shape[0]
    lower = np.tril(layout) if diagonal else layout
    covered = np.zeros_like(lower)
    out = []
    a = 0 if diagonal else nb
    while a < nb:
        if not lower[a, a]:
            a += 1
            continue
        b = a + 1
        while b < nb and lower[b, a : b + 1].all():
            b += 1
        covered[a:b, a:b] = np.tril(np.ones((b - a, b - a), dtype=bool))
        out.append(Rect(a * block, b * block, a * block, b * block, True))
        a = b
    rest = lower & ~covered
    open_runs: dict[tuple[int, int], int] = {}  # run -> first row
    for row in range(nb + 1):
        runs = set(_runs(rest[row])) if row < nb else set()
        for run in list(open_runs):
            if run not in runs:
                first = open_runs.pop(run)
                out.append(Rect(first * block, row * block, run[0] * block, run[1] * block, False))
        for run in runs:
            open_runs.setdefault(run, row)
    return out


def _runs(row: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True in a bool row."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], row.view(np.int8), [0]))))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


@dataclass(frozen=True)
class Call:
    """One kernel call: query heads [h0, h1) with kv heads [g0, g1), rows and keys in tokens,
    `bias`: whether the documents or the window cut through it (an additive mask)."""

    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    bias: bool


class SparsePlan:
    """What one layer's block-sparse attention computes for a sequence length and this rank's
    heads: the layout's rectangles per head group, built once and kept (`plans` cache)."""

    def __init__(
        self,
        pattern: SparsityPattern,
        num_heads: int,
        heads: Sequence[int],
        kv_heads: int,
        seq_length: int,
        seed: int,
        layer: int,
    ):
        self.block = pattern.block
        local = len(heads)
        group = local // kv_heads

        def layout(h: int) -> np.ndarray:  # one head's layout at a time
            return block_layout(
                pattern, num_heads, seq_length, seed=seed, layer=layer, heads=[heads[h]]
            )[0].numpy()

        self.groups: list[tuple[tuple[int, int], tuple[int, int], list[Rect]]] = []
        if not pattern.different_layout_per_head:
            self.groups.append(((0, local), (0, kv_heads), rectangles(layout(0), self.block)))
        else:
            for h in range(local):
                rects = rectangles(layout(h), self.block)
                self.groups.append(((h, h + 1), (h // group, h // group + 1), rects))

    def calls(self, window: Optional[int], documents: Optional["_Starts"]) -> list[Call]:
        """Every kernel call, with the rectangles the documents or the window exclude left
        out (host arithmetic only)."""
        out = []
        for heads, kv, rects in self.groups:
            for r in rects:
                cut = _cut(r, window, documents)
                if cut is None:
                    continue
                for q0 in range(r.q0, r.q1, MASK_TILE_ROWS) if cut else (r.q0,):
                    q1 = min(q0 + MASK_TILE_ROWS, r.q1) if cut else r.q1
                    out.append(Call(heads, kv, q0, q1, r.k0, r.k1, r.causal and not cut, cut))
        return out


@dataclass(frozen=True)
class _Starts:
    """Document starts per sample (host) and each token's document id [b, N] (device)."""

    starts: tuple[tuple[int, ...], ...]
    length: int
    ids: torch.Tensor

    @classmethod
    def of(cls, documents: DocumentMask) -> "_Starts":
        n = documents.seq_length
        starts: list[list[int]] = [[] for _ in range(documents.batch_size)]
        for offset in documents.offsets[:-1]:
            sample, position = divmod(offset, n)
            starts[sample].append(position)
        return cls(tuple(tuple(s) for s in starts), n, documents.token_documents())

    def end_of(self, sample: int, position: int) -> int:
        """The end of the document that holds `position`."""
        later = [s for s in self.starts[sample] if s > position]
        return later[0] if later else self.length


def _cut(r: Rect, window: Optional[int], documents: Optional[_Starts]) -> Optional[bool]:
    """None: nothing in the rectangle is visible; True: a mask is needed; False: it runs as
    it is. The closest (query, key) pair of a rectangle is its first row and last key (first
    key of a diagonal square), the farthest its last row and first key."""
    nearest = max(r.q0 - (r.k1 - 1), 0)
    farthest = r.q1 - 1 - r.k0
    if window is not None and nearest > window:
        return None
    cut = window is not None and farthest > window
    if documents is not None:
        samples = range(len(documents.starts))
        if not r.causal and all(documents.end_of(s, r.k1 - 1) <= r.q0 for s in samples):
            return None
        cut = cut or any(documents.end_of(s, r.k0) < r.q1 for s in samples)
    return cut


def _bias(call: Call, window, documents: Optional[_Starts], dtype, device) -> torch.Tensor:
    """Additive mask [b or 1, 1, rows, keys] (0 visible, -inf hidden): causality, the window
    and the documents from token positions; rows padded to CUDA's 16-element alignment."""
    qpos = torch.arange(call.q0, call.q1, device=device)
    kpos = torch.arange(call.k0, call.k1, device=device)
    distance = qpos.unsqueeze(1) - kpos.unsqueeze(0)
    hidden = (distance < 0).unsqueeze(0)
    if window is not None:
        hidden = hidden | (distance > window)
    if documents is not None:
        ids = documents.ids
        hidden = hidden | (ids[:, qpos].unsqueeze(2) != ids[:, kpos].unsqueeze(1))
    keys = call.k1 - call.k0
    width = -(-keys // lse_kernels.BIAS_ALIGN) * lse_kernels.BIAS_ALIGN
    rows = call.q1 - call.q0
    bias = torch.zeros(hidden.shape[0], 1, rows, width, dtype=dtype, device=device)[..., :keys]
    return bias.masked_fill_(hidden.unsqueeze(1), float("-inf"))


def _merge(out, lse, part_out, part_lse):
    """Log-sum-exp merge of one call's result into (out, lse), in place."""
    new_lse = torch.logaddexp(lse, part_lse)
    finite = torch.isfinite(new_lse)
    safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
    old_w = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(lse))
    new_w = torch.where(finite, torch.exp(part_lse - safe), torch.zeros_like(lse))
    out.mul_(old_w.unsqueeze(-1)).add_(part_out * new_w.unsqueeze(-1))
    lse.copy_(new_lse)


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.permute(1, 2, 0, 3)  # [N, b, h, d] -> [b, h, N, d], a view


def _views(call: Call, q, k, v):
    h, g = slice(*call.heads), slice(*call.kv_heads)
    rows, keys = slice(call.q0, call.q1), slice(call.k0, call.k1)
    return h, rows, q[:, h, rows], k[:, g, keys], v[:, g, keys]


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, calls, window, documents, kernels, scale):
        dense, masked = kernels
        out = torch.zeros(q.shape, dtype=lse_kernels.lse_dtype(q.dtype), device=q.device)
        lse = torch.full(
            (q.shape[1], q.shape[2], q.shape[0]), float("-inf"), dtype=out.dtype, device=q.device
        )
        qh, kh, vh, oh = (_heads_first(t) for t in (q, k, v, out))
        for call in calls:
            h, rows, q_, k_, v_ = _views(call, qh, kh, vh)
            kernel = masked if call.bias else dense
            bias = _bias(call, window, documents, q.dtype, q.device) if call.bias else None
            part, part_lse = kernel.forward(q_, k_, v_, call.causal, bias, scale)
            _merge(oh[:, h, rows], lse[:, h, rows], part, part_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.calls, ctx.window, ctx.documents = calls, window, documents
        ctx.kernels, ctx.scale = kernels, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dense, masked = ctx.kernels
        wide = lse.dtype
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        dk = torch.zeros(k.shape, dtype=wide, device=q.device)
        dv = torch.zeros(v.shape, dtype=wide, device=q.device)
        qh, kh, vh = (_heads_first(t) for t in (q, k, v))
        doh, oh = _heads_first(dout.to(q.dtype)), _heads_first(out)
        dqh, dkh, dvh = (_heads_first(t) for t in (dq, dk, dv))
        for call in ctx.calls:
            h, rows, q_, k_, v_ = _views(call, qh, kh, vh)
            g, keys = slice(*call.kv_heads), slice(call.k0, call.k1)
            kernel = masked if call.bias else dense
            bias = _bias(call, ctx.window, ctx.documents, q.dtype, q.device) if call.bias else None
            gq, gk, gv = kernel.backward(
                doh[:, h, rows],
                q_,
                k_,
                v_,
                oh[:, h, rows],
                lse[:, h, rows],
                call.causal,
                bias,
                ctx.scale,
            )
            dqh[:, h, rows].add_(gq)
            dkh[:, g, keys].add_(gk)
            dvh[:, g, keys].add_(gv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def unit_kernels(device: torch.device, dtype: torch.dtype) -> tuple[UnitKernel, UnitKernel]:
    """(unmasked, masked) kernels of the rectangles: torch's CPU flash kernel on the CPU, its
    memory-efficient kernel on CUDA (the softmax written out for fp64)."""
    if device.type != "cuda":
        return lse_kernels.CPU_FLASH, lse_kernels.CPU_FLASH
    if dtype == torch.float64:
        return lse_kernels.REFERENCE, lse_kernels.REFERENCE
    return lse_kernels.SDPA_EFFICIENT, lse_kernels.SDPA_EFFICIENT


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: SparsePlan,
    *,
    documents: Optional[DocumentMask] = None,
    window: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    kernels: Optional[tuple[UnitKernel, UnitKernel]] = None,
) -> torch.Tensor:
    """Causal block-sparse attention on whole heads. q [N, b, hq, d]; k, v [N, b, hk, d];
    `plan` made for N and these heads. Returns [N, b, hq, d] in q's dtype."""
    n = q.shape[0]
    if documents is not None and documents.seq_length != n:
        raise ValueError(
            f"document offsets are for sequences of {documents.seq_length} tokens, "
            f"attention got {n}"
        )
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    starts = None if documents is None else _Starts.of(documents)
    calls = plan.calls(window, starts)
    chosen = kernels if kernels is not None else unit_kernels(q.device, q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        return _BlockSparseAttention.apply(q, k, v, calls, window, starts, chosen, scale)


class LayerSparsity:
    """One layer's pattern and its plans, one per (sequence length, heads, kv heads): the
    layout is drawn and cut into rectangles once per shape, not per micro-batch."""

    def __init__(self, pattern: SparsityPattern, num_heads: int, seed: int, layer: int):
        self.pattern, self.num_heads, self.seed, self.layer = pattern, num_heads, seed, layer
        self._plans: dict = {}

    def plan(self, seq_length: int, heads: Sequence[int], kv_heads: int) -> SparsePlan:
        key = (seq_length, tuple(heads), kv_heads)
        if key not in self._plans:
            self._plans[key] = SparsePlan(
                self.pattern, self.num_heads, heads, kv_heads, seq_length, self.seed, self.layer
            )
        return self._plans[key]


__all__ = [
    "SparsePlan",
    "LayerSparsity",
    "block_sparse_attention",
    "rectangles",
    "Rect",
]
