"""The blocked-attention engine: attention over a plan of blocks, each (query rows, key rows,
mask), run on a unit kernel (lse_kernels) and merged by the log-sum-exp.

    lse = logaddexp(lse_a, lse_b),   out = out_a·exp(lse_a - lse) + out_b·exp(lse_b - lse)

Backward is FlashAttention's: with the final output and log-sum-exp of every row, a block's
probabilities are exp(S - lse), so each block's share of dq, dk, dv needs nothing else and is
added into the accumulators where it lands. The document tiles (document_tiles.py), the
per-document blocks' backward (documents.py), the ring's units (ring.py) and the block-sparse
layouts (block_sparse.py, block_sparse_ring.py: through `layout_blocks`) are plans of this
engine; `BlockedAttention` is its autograd function.

Tensors keep the model's layouts: q, out, dout, dq [L, b, hq, d] and k, v, dk, dv [Lk, b, hk,
d], rows first; lse [b, hq, L]. A block's operands are views of them (no copy to a blocked
layout). Masks are never materialised beyond one block: `MaskRules.bias` builds a block's
additive bias from token positions (causality, the window, the documents' ids).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import lse_kernels
from .lse_kernels import UnitKernel


class Mask(enum.Enum):
    FULL = "full"  # every query row sees every key of the block
    CAUSAL = "causal"  # the kernel's own causal flag: a diagonal square, top-left aligned
    BIAS = "bias"  # an additive bias from token positions (MaskRules.bias)


@dataclass(frozen=True)
class Block:
    """Query rows [q0, q1) against key rows [k0, k1) of their tensors. `sample`: one sample of
    the batch (None: all in one call). `q_at`, `k_at`: the global token positions of rows q0
    and k0 (None: the row numbers themselves), what the bias is built from. `heads`: query
    heads [h0, h1) with their kv heads (None: every head)."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: Mask = Mask.FULL
    sample: int | None = None
    q_at: int | None = None
    k_at: int | None = None
    heads: tuple[int, int] | None = None

    @property
    def masked(self) -> bool:
        return self.mask is Mask.BIAS

    def q_positions(self) -> tuple[int, int]:
        start = self.q0 if self.q_at is None else self.q_at
        return start, start + self.q1 - self.q0

    def k_positions(self) -> tuple[int, int]:
        start = self.k0 if self.k_at is None else self.k_at
        return start, start + self.k1 - self.k0


@dataclass(frozen=True)
class MaskRules:
    """What hides a key from a query besides the plan: causality (always), the window (a
    query sees keys up to `window` positions back) and the documents (`ids` [b, N]: each
    global position's document)."""

    window: int | None = None
    ids: torch.Tensor | None = None

    def bias(self, block: Block, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The block's additive mask [b or 1, 1, rows, keys]: 0 visible, -inf hidden. Its rows
        are padded to a multiple of lse_kernels.BIAS_ALIGN elements (the CUDA efficient
        kernel's alignment)."""
        qpos = torch.arange(*block.q_positions(), device=device)
        kpos = torch.arange(*block.k_positions(), device=device)
        # compared into bool directly: no [rows, keys] int64 distance
        hidden = (kpos.unsqueeze(0) > qpos.unsqueeze(1)).unsqueeze(0)
        if self.window is not None:
            hidden |= kpos.unsqueeze(0) < (qpos - self.window).unsqueeze(1)
        if self.ids is not None:
            ids = self.ids if block.sample is None else self.ids[block.sample : block.sample + 1]
            hidden = hidden | (ids[:, qpos].unsqueeze(2) != ids[:, kpos].unsqueeze(1))
        keys = kpos.numel()
        width = -(-keys // lse_kernels.BIAS_ALIGN) * lse_kernels.BIAS_ALIGN
        bias = torch.zeros(hidden.shape[0], 1, hidden.shape[1], width, dtype=dtype, device=device)
        return bias[..., :keys].masked_fill_(hidden.unsqueeze(1), float("-inf"))


@dataclass(frozen=True)
class Kernels:
    """The unit kernels of a plan: `full` for unmasked and causal blocks, `masked` for blocks
    with a bias (it must take one)."""

    full: UnitKernel
    masked: UnitKernel

    def of(self, block: Block) -> UnitKernel:
        return self.masked if block.mask is Mask.BIAS else self.full


def merge(out, lse, part_out, part_lse) -> None:
    """Log-sum-exp merge of a block's partial result into (out, lse), in place; rows that no
    key has reached yet (lse -inf on both sides) stay 0 / -inf."""
    new_lse = torch.logaddexp(lse, part_lse)
    finite = torch.isfinite(new_lse)
    safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
    old_w = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(lse))
    new_w = torch.where(finite, torch.exp(part_lse - safe), torch.zeros_like(lse))
    out.mul_(old_w.unsqueeze(-1)).add_(part_out * new_w.unsqueeze(-1))
    lse.copy_(new_lse)


def _kv_heads(block: Block, q_heads: int, kv_heads: int) -> tuple[int, int] | None:
    if block.heads is None:
        return None
    h0, h1 = block.heads
    group = q_heads // kv_heads
    if h1 - h0 < group:  # part of one group: its kv head
        return h0 // group, h0 // group + 1
    return h0 // group, h1 // group


def rows(t: torch.Tensor, a: int, b: int, sample, heads) -> torch.Tensor:
    """Rows [a, b) of t [L, b, h, d] as the kernels take them, [b or 1, h, rows, d] (a view)."""
    t = t[a:b] if sample is None else t[a:b, sample : sample + 1]
    if heads is not None:
        t = t[:, :, heads[0] : heads[1]]
    return t.permute(1, 2, 0, 3)


def lse_rows(lse: torch.Tensor, a: int, b: int, sample, heads) -> torch.Tensor:
    """Rows [a, b) of lse [b, h, L], [b or 1, h, rows] (a view)."""
    t = lse if sample is None else lse[sample : sample + 1]
    if heads is not None:
        t = t[:, heads[0] : heads[1]]
    return t[..., a:b]


def _operands(block: Block, q, k, v):
    kvh = _kv_heads(block, q.shape[2], k.shape[2])
    return (
        rows(q, block.q0, block.q1, block.sample, block.heads),
        rows(k, block.k0, block.k1, block.sample, kvh),
        rows(v, block.k0, block.k1, block.sample, kvh),
    )


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    blocks: Iterable[Block],
    kernels: Kernels,
    rules: MaskRules,
    scale: float,
    dropout_p: float = 0.0,
) -> list:
    """Attend every block and merge it into out [L, b, hq, d] and lse [b, hq, L] (fp32, or
    fp64 for fp64) in place. With attention dropout (torch's efficient kernel only) returns
    each block's Philox, which its backward needs."""
    philox = []
    for block in blocks:
        bias = rules.bias(block, q.dtype, q.device) if block.mask is Mask.BIAS else None
        qb, kb, vb = _operands(block, q, k, v)
        causal = block.mask is Mask.CAUSAL
        if dropout_p > 0:
            part, part_lse, drawn = lse_kernels.efficient_attention(
                qb, kb, vb, causal, bias, scale, dropout_p
            )
            philox.append(drawn)
        else:
            part, part_lse = kernels.of(block).forward(qb, kb, vb, causal, bias, scale)
        merge(
            rows(out, block.q0, block.q1, block.sample, block.heads),
            lse_rows(lse, block.q0, block.q1, block.sample, block.heads),
            part,
            part_lse,
        )
        del part, part_lse, bias, qb, kb, vb
    return philox


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    blocks: Sequence[Block],
    kernels: Kernels,
    rules: MaskRules,
    scale: float,
    dropout_p: float = 0.0,
    philox: list | None = None,
) -> None:
    """Add every block's share of the gradients into dq [L, b, hq, d], dk, dv [Lk, b, hk, d]
    in place; out and lse are the final (merged) output and log-sum-exp. Only one block's
    gradients exist besides the accumulators at a time."""
    for i, block in enumerate(blocks):
        bias = rules.bias(block, q.dtype, q.device) if block.mask is Mask.BIAS else None
        sample, heads = block.sample, block.heads
        qb, kb, vb = _operands(block, q, k, v)
        args = (
            rows(dout, block.q0, block.q1, sample, heads),
            qb,
            kb,
            vb,
            rows(out, block.q0, block.q1, sample, heads),
            lse_rows(lse, block.q0, block.q1, sample, heads),
            block.mask is Mask.CAUSAL,
            bias,
            scale,
        )
        if dropout_p > 0:
            assert philox is not None
            grads = lse_kernels.efficient_attention_backward(*args, dropout_p, philox[i])
        else:
            grads = kernels.of(block).backward(*args)
        kvh = _kv_heads(block, q.shape[2], k.shape[2])
        for target, (a, b), h, grad in zip(
            (dq, dk, dv),
            ((block.q0, block.q1), (block.k0, block.k1), (block.k0, block.k1)),
            (heads, kvh, kvh),
            grads,
        ):
            rows(target, a, b, sample, h).add_(grad)
        del grads, grad, bias, args, qb, kb, vb  # not alive while the next block's are made


def layout_blocks(
    layout,
    block_size: int,
    *,
    head: int | None = None,
    causal: bool = True,
    heads: tuple[int, int] | None = None,
) -> list[Block]:
    """The plan of one head's block layout ([nq_blocks, nk_blocks] 0/1, DeepSpeed's format, a
    tensor or an array on the host), each nonzero block computed once. With `causal`, key
    blocks after the query block are dropped and diagonal squares [a, b) x [a, b) whose lower
    triangle the layout holds entirely run the kernel's causal flag (one call for a run of
    diagonal blocks: a local window); without it every block of the layout is visible (a
    piece wholly below the diagonal, e.g. a ring unit of earlier keys). The rest is cut row by
    row into runs of consecutive key blocks, and a run that the next rows repeat exactly (a
    global column, a band of leading blocks) grows downwards into one block. `head`: the
    query head the layout is for, `heads`: the query heads [h0, h1) that share it (neither:
    every head)."""
    grid = np.asarray(layout.cpu() if isinstance(layout, torch.Tensor) else layout).astype(bool)
    nb = grid.shape[0]
    if head is not None:
        heads = (head, head + 1)
    size = block_size
    lower = np.tril(grid) if causal else grid
    covered = np.zeros_like(lower)
    plan = []
    a = 0 if causal else nb
    while a < nb:
        if not lower[a, a]:
            a += 1
            continue
        b = a + 1
        while b < nb and lower[b, a : b + 1].all():
            b += 1
        covered[a:b, a:b] = np.tril(np.ones((b - a, b - a), dtype=bool))
        plan.append(Block(a * size, b * size, a * size, b * size, Mask.CAUSAL, heads=heads))
        a = b
    rest = lower & ~covered
    open_runs: dict[tuple[int, int], int] = {}  # run of key blocks -> its first row
    for row in range(nb + 1):
        runs = set(_runs(rest[row])) if row < nb else set()
        for run in [r for r in open_runs if r not in runs]:
            first = open_runs.pop(run)
            plan.append(Block(first * size, row * size, run[0] * size, run[1] * size, heads=heads))
        for run in sorted(runs):
            open_runs.setdefault(run, row)
    return plan


def _runs(row: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True in a bool row."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], row.view(np.int8), [0]))))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


class BlockedAttention(torch.autograd.Function):
    """q [N, b, hq, d], k, v [Lk, b, hk, d] -> [N, b, hq, d] over a plan of blocks; keeps q, k,
    v, the output and the log-sum-exp (with dropout each block's Philox seed and offset).
    Rows no block reaches give 0."""

    @staticmethod
    def forward(ctx, q, k, v, plan, kernels, rules, scale, dropout_p):
        acc = lse_kernels.lse_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(
            (q.shape[1], q.shape[2], q.shape[0]), float("-inf"), dtype=acc, device=q.device
        )  # [b, hq, N]
        philox = forward(q, k, v, out, lse, plan, kernels, rules, scale, dropout_p)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan, kernels, rules, scale
        ctx.dropout = dropout_p, philox
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, kernels, rules, scale = ctx.plan
        dropout_p, philox = ctx.dropout
        dq, dk, dv = (torch.zeros(t.shape, dtype=lse.dtype, device=t.device) for t in (q, k, v))
        backward(
            dout.to(q.dtype), q, k, v, out, lse, dq, dk, dv, plan, kernels, rules, scale,
            dropout_p, philox,
        )  # fmt: skip
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 5)
