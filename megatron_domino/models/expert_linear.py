"""A rank's experts applied to their rows: a loop of GEMMs, or one grouped GEMM per projection.

Rows arrive grouped by local expert (``sizes`` of each). The loop runs one ``F.linear`` per expert. The
grouped form (``model.moe_grouped_gemm``) stacks the experts' weights into [E, out, in] and runs torch's
``grouped_mm`` once; CUDA's fast kernel needs bf16 on sm90+, elsewhere torch loops inside. Its backward
stacks the weights again instead of keeping the stack: autograd would otherwise hold a copy of every
local expert's weights per layer and micro-batch in flight. Biases (gate-weighted partials under TP, so
divided by tp) are added per row after the product. FP8 experts run as ``fp8.grouped``'s one step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fp8 import grouped as fp8_grouped
from ..fp8.linear import linear as product
from ..parallel.device import to_device

# torch's grouped GEMM: public since 2.9, private before
grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class _GroupedLinear(torch.autograd.Function):
    """rows [n, in] grouped by expert (``ends``: cumulative sizes, int32) times each expert's weight [out, in]."""

    @staticmethod
    def forward(ctx, rows, ends, *weights):
        ctx.save_for_backward(rows, ends, *weights)  # the parameters themselves, not their stack
        ctx.gradients = (True, True)  # (input, weight); ``gradient_pass`` narrows it for a split backward
        return grouped_mm(rows, torch.stack(weights).transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx, grad):
        rows, ends, *weights = ctx.saved_tensors
        inputs, weights_wanted = ctx.gradients
        grad = grad.contiguous()
        grad_rows = None
        if inputs and ctx.needs_input_grad[0]:
            grad_rows = grouped_mm(grad, torch.stack(weights), offs=ends)
        if not weights_wanted:  # I of a split backward: W computes these later
            return grad_rows, None, *[None] * len(weights)
        grad_weights = grouped_mm(grad.t(), rows, offs=ends).unbind(0)  # groups along the contracted rows
        return grad_rows, None, *grad_weights


def experts_linear(rows: torch.Tensor, sizes: list[int], linears: list, grouped: bool,
                   bias_divisor: int = 1) -> torch.Tensor:
    """Expert e's ``linears[e]`` on its ``sizes[e]`` rows, for every local expert: [n, out]. In FP8
    (``linear.fp8``): ``fp8.grouped``'s one step where the recipe allows (its grouped kernel if ``grouped``),
    else the loop."""
    fp8 = linears[0].fp8
    if fp8 is not None and fp8_grouped.takes(fp8):
        return fp8_grouped.experts_linear(rows, sizes, linears, bias_divisor, one_gemm=grouped)
    if not grouped or rows.shape[0] == 0 or fp8 is not None:  # grouped_mm refuses an empty operand
        return torch.cat([product(part, linear.weight, None if linear.bias is None else linear.bias / bias_divisor,
                                  linear.fp8) for part, linear in zip(rows.split(sizes), linears)])
    # one non-blocking copy of the host counts (a plain torch.tensor(...).to(device) would block the host)
    counts = to_device(torch.tensor(sizes, dtype=torch.int32), rows.device)
    ends = counts.cumsum(0, dtype=torch.int32)
    out = _GroupedLinear.apply(rows, ends, *(linear.weight for linear in linears))
    if linears[0].bias is None:
        return out
    expert_of_row = torch.repeat_interleave(counts, output_size=rows.shape[0])
    return out + (torch.stack([linear.bias for linear in linears]) / bias_divisor)[expert_of_row]
