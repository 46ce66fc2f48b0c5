"""A column-parallel linear computed in two parts of its output, with the one backward of the whole linear.

Why: Ulysses exchanges the queries across the CP ranks; made first, their all-to-all flies while the keys and
values are projected (``models.attention``). The QKV weight interleaves its parts group by group (per K/V
group: its query heads, its key, its value), so the first part is the leading ``first`` features of every
group and the rest follows. Two linears would each reduce their input gradient over TP (and under SP each
would gather the input): twice the communication. Here one autograd step makes the first part and the other
part only reads its operands, so backward joins both parts' gradients into the whole linear's output
gradient and runs that linear's backward once: one input-gradient all-reduce (Domino's pieces and async
launch included), the weight gradient whole, and a zero-bubble split backward (``gradient_pass``) as for any
linear. The rest hands its gradient to the first step through a placeholder output (a zero-stride view), so
autograd orders the two: the rest's backward runs first.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..fp8.linear import linear_backward
from ..parallel import comm
from .async_comm import PendingInputGradient, WaitForInputGradient
from .context import LayerContext


@dataclass
class _Parts:
    """The cut (``groups`` groups, the first ``first`` features of each), the Domino input-gradient reduction
    (None: the TP entry before the linear reduces it), and the rest's operands until the rest is made."""

    groups: int
    first: int
    pending: PendingInputGradient | None
    rest_operands: tuple | None = None

    def cut(self, t: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(first part, rest) of a weight or bias along its output features, each contiguous."""
        if t is None:
            return None, None
        grouped = t.view(self.groups, -1, *t.shape[1:])
        return (grouped[:, :self.first].reshape(-1, *t.shape[1:]),
                grouped[:, self.first:].reshape(-1, *t.shape[1:]))

    def join(self, grad_first: torch.Tensor, grad_rest: torch.Tensor) -> torch.Tensor:
        """The whole output's gradient from its two parts'."""
        lead = grad_first.shape[:-1]
        whole = grad_first.new_empty(*lead, self.groups, self.first + grad_rest.shape[-1] // self.groups)
        whole[..., :self.first] = grad_first.reshape(*lead, self.groups, -1)
        whole[..., self.first:] = grad_rest.reshape(*lead, self.groups, -1)
        return whole.view(*lead, -1)


class _FirstPart(torch.autograd.Function):
    """(the first part of x W^T + b, the rest's placeholder); backward: the whole linear's."""

    @staticmethod
    def forward(ctx, x, weight, bias, parts: _Parts):
        pending = parts.pending
        if pending is not None and pending.sequence_parallel:  # this rank's sequence slice -> the whole sequence
            x = comm.gather_sequence(x, pending.group)
        ctx.save_for_backward(x, weight)
        ctx.parts, ctx.has_bias, ctx.fp8, ctx.scales = parts, bias is not None, None, None
        ctx.gradients = (True, True)  # (input, weight); ``gradient_pass`` narrows it for a split backward
        (weight_first, weight_rest), (bias_first, bias_rest) = parts.cut(weight), parts.cut(bias)
        parts.rest_operands = (x, weight_rest, bias_rest)
        out = F.linear(x, weight_first, bias_first)
        return out, out.new_zeros(()).expand(*out.shape[:-1], weight_rest.shape[0])

    @staticmethod
    def backward(ctx, grad_first, grad_rest):
        parts, needed = ctx.parts, ctx.needs_input_grad[0]
        if parts.pending is not None:
            input_grad = lambda products: parts.pending.launch(products, products.weight.shape[1])  # noqa: E731
        else:
            input_grad = lambda products: products.input_grad() if needed else None  # noqa: E731
        return *linear_backward(ctx, parts.join(grad_first, grad_rest), input_grad), None


class _RestPart(torch.autograd.Function):
    """The rest of the output from the operands the first part kept; its gradient goes to the placeholder."""

    @staticmethod
    def forward(ctx, placeholder, parts: _Parts):
        (x, weight, bias), parts.rest_operands = parts.rest_operands, None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def column_linear_in_parts(x, weight, bias, ctx: LayerContext, groups: int, first: int):
    """(the first ``first`` output features of each of ``groups`` groups, a function making the rest), this
    rank's piece of a column-parallel linear with its TP entry as ``layers.column_parallel_linear`` has it."""
    pending = None
    if ctx.grad_pieces > 0:
        pending = PendingInputGradient(ctx.group, ctx.grad_pieces, ctx.sequence_parallel, ctx.turns)
        x = WaitForInputGradient.apply(x, pending)
    elif ctx.sequence_parallel:
        x = comm.gather_from_sp(x, ctx.group)
    else:
        x = comm.copy_to_tp(x, ctx.group)
    parts = _Parts(groups, first, pending)
    out, placeholder = _FirstPart.apply(x, weight, bias, parts)
    return out, lambda: _RestPart.apply(placeholder, parts)
