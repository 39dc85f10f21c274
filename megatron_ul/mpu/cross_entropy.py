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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_size, group):
        tp = group_size(group)
        local_vocab = logits.shape[-1]
        padded = local_vocab * tp
        start, end = vocab_range(padded, group)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the softmax and its sums always in fp32 or better
        if end > vocab_size:  # this rank holds padding rows: take them out of the softmax
            pad = torch.arange(start, end, device=logits.device) >= vocab_size
            logits = logits.masked_fill(pad, float("-inf"))

        logits_max = logits.max(dim=-1)[0]
        if tp > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        picked = all_reduce(picked.masked_fill(outside, 0.0), group)

        exp = shifted.exp_()  # `shifted` is not needed any more: no second vocab-sized buffer
        sum_exp = all_reduce(exp.sum(dim=-1), group)
        loss = sum_exp.log() - picked

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # saved buffer is not needed afterwards: update in place
        # softmax - onehot(target) on the rank holding the target, without a vocab-sized
        # one-hot tensor: subtract 1 at the target column only (adding -0 elsewhere is exact).
        minus_one = -(~outside).unsqueeze(-1).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), minus_one)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_size: int, group
) -> torch.Tensor:
    """Per-token loss (fp32, or fp64 for fp64 logits) for logits [..., padded_vocab/TP] split
    over the TP `group` (None: one rank holds them all) and target ids [...]."""
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_size, group)
