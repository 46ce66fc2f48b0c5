"""Cross entropy over vocab-parallel logits, without ever gathering the full vocabulary.

Each rank holds logits for its block of the (padded) vocabulary. Three small all-reduces over
TP (max, sum of exponentials, target logit) give the exact per-token loss; the gradient is
softmax minus one-hot, computed locally. Padded vocabulary entries are masked to -inf so
padding never changes the loss.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import comm
from .embedding import vocab_range


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_size, group):
        tp = comm.group_size(group)
        tp_rank = comm.group_rank(group)
        start, end = vocab_range(logits.shape[-1] * tp, tp_rank, tp)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # 16-bit logits in fp32, fp64 as is
        if end > vocab_size:  # this rank holds padding columns (known without looking at the device)
            padded_columns = torch.arange(start, end, device=logits.device) >= vocab_size
            logits = logits.masked_fill(padded_columns, float("-inf"))
        local_max = logits.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if tp > 1:
            stacked = torch.stack([target_logit, sum_exp])
            dist.all_reduce(stacked, group=group)
            target_logit, sum_exp = stacked[0], stacked[1]
        loss = sum_exp.log() - target_logit
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax
        inside = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -inside.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int, group) -> torch.Tensor:
    """Per-token loss [..] (fp32, or fp64 from fp64 logits) from this rank's logits [.., padded_vocab / tp]."""
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_size, group)
