"""Cross entropy over logits split by vocabulary across TP, without gathering the logits.

Padded vocabulary rows (ids >= the real vocab size) are excluded from the softmax, so the
model's function does not depend on how much padding the TP layout needed; this differs from
Megatron-LM, where padded logits take part in the softmax, and makes every TP layout (and a
Hugging Face export, which drops the padding) compute exactly the same loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .layers import vocab_range
from .mappings import all_reduce, group_size

# fp32 elements of one row block's softmax temporaries: with a 32000-entry vocabulary, 128
# rows (16 MiB); a tiled loss chunk of 1024 tokens holds 62.5 MiB of bf16 logits beside it.
ROW_BLOCK_ELEMENTS = 2**22


def _row_blocks(rows: int, vocab: int) -> range:
    step = max(1, ROW_BLOCK_ELEMENTS // max(vocab, 1))
    return range(0, rows, step)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Keeps the logits (in their own dtype; the output layer made them and nothing copies
    them) and two fp32 numbers per row, the maximum and the sum of exponentials. The softmax
    is computed block of rows by block of rows in fp32, in forward and again in backward,
    with the same operations per element as a whole-tensor computation, so neither an fp32
    copy of the logits nor a shifted copy of them ever exists, only one block's."""

    @staticmethod
    def forward(ctx, logits, target, vocab_size, group):
        tp = group_size(group)
        local_vocab = logits.shape[-1]
        start, end = vocab_range(local_vocab * tp, group)
        valid = min(end, vocab_size) - start  # this rank's columns before the padding
        flat = logits.reshape(-1, local_vocab)
        # the softmax and its sums always in fp32 or better
        wide = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        # max over the rank's real rows: exact in the logits' dtype (a comparison)
        logits_max = flat[:, :valid].amax(dim=-1).to(wide)
        if tp > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)

        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0).reshape(-1)
        picked = flat.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).to(wide) - logits_max
        picked = all_reduce(picked.masked_fill(outside.reshape(-1), 0.0), group)

        sum_exp = torch.empty_like(logits_max)
        for r in _row_blocks(flat.shape[0], local_vocab):
            exp = _shifted_exp(flat, r, local_vocab, logits_max, valid, wide)
            sum_exp[r : r + exp.shape[0]] = exp.sum(dim=-1)
            del exp
        sum_exp = all_reduce(sum_exp, group)
        loss = sum_exp.log() - picked

        ctx.save_for_backward(logits, logits_max, sum_exp, local_target, outside)
        ctx.valid, ctx.wide = valid, wide
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, logits_max, sum_exp, local_target, outside = ctx.saved_tensors
        local_vocab = logits.shape[-1]
        flat = logits.reshape(-1, local_vocab)
        grad = torch.empty_like(flat)  # in the logits' dtype, as autograd would cast it
        scale = grad_loss.reshape(-1, 1)
        # softmax - onehot(target) on the rank holding the target, without a vocab-sized
        # one-hot tensor: subtract 1 at the target column only (adding -0 elsewhere is exact).
        minus_one = -(~outside.reshape(-1, 1)).to(ctx.wide)
        for r in _row_blocks(flat.shape[0], local_vocab):
            block = _shifted_exp(flat, r, local_vocab, logits_max, ctx.valid, ctx.wide)
            rows = slice(r, r + block.shape[0])
            block.div_(sum_exp[rows].unsqueeze(-1))
            block.scatter_add_(-1, local_target[rows].unsqueeze(-1), minus_one[rows])
            grad[rows] = block.mul_(scale[rows])
            del block
        return grad.view(logits.shape), None, None, None


def _shifted_exp(flat, r, local_vocab, logits_max, valid, wide) -> torch.Tensor:
    """exp(logits - max) of the block of rows starting at r, in `wide`; padding columns 0."""
    step = _row_blocks(flat.shape[0], local_vocab).step
    rows = slice(r, min(r + step, flat.shape[0]))
    block = flat[rows].to(wide, copy=True)
    if valid < local_vocab:  # this rank holds padding rows: take them out of the softmax
        block[:, valid:] = float("-inf")
    return block.sub_(logits_max[rows].unsqueeze(-1)).exp_()


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_size: int, group
) -> torch.Tensor:
    """Per-token loss (fp32, or fp64 for fp64 logits) for logits [..., padded_vocab/TP] split
    over the TP `group` (None: one rank holds them all) and target ids [...]."""
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_size, group)
