"""A rank's experts in FP8 as one autograd step (tensorwise or delayed scaling).

A loop of one FP8 linear per expert would, with tensorwise scaling under expert TP, ask for each expert's own
amax all-reduces: two per expert in fc2's forward, one in fc1's forward and one in its backward, each on the
critical path of a GEMM. Here every expert keeps the scales the loop gives it (its own amaxes, reduced with MAX
where the tensor is split, which is exact; delayed: the history's), so the numbers are the loop's bit for bit,
but one all-reduce carries all of a projection's amaxes (forward: inputs and weights; backward: the gradients).

With ``model.moe_grouped_gemm`` on CUDA, where the model computes in bf16 and both operands are e4m3, the
experts' products run as one grouped GEMM (``torch._scaled_grouped_mm``: row-wise scales, bf16 output; Hopper):
the forward's, and the input gradient's with ``model.fp8_grad_format: e4m3``. A probe once per device keeps it
only if it agrees with an fp64 emulation (``grouped_kernel``). The weight gradients contract each expert's tokens
and run expert by expert. Blockwise scaling needs no collective (tiles stay inside a rank) and has no grouped
kernel here: it loops, as delayed scaling's calibration step does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import comm
from ..parallel.device import to_device
from . import grouped_kernel
from .quantize import quantize_tensorwise, scaled_mm
from .grouped_kernel import E4M3
from .scaling import GRAD, INPUT, WEIGHT, LinearScaling


def takes(scaling: LinearScaling) -> bool:
    """Whether this path runs the experts (else the per-expert loop: blockwise, or delayed's calibration step)."""
    return scaling.recipe.kind in ("tensorwise", "delayed") and not scaling.calibrating


def operand_scales(scaling: LinearScaling, operands: dict[int, list[torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Each expert's scale [E] per operand, as ``LinearScaling.scale`` gives them one at a time, with one
    all-reduce for every split operand's amaxes together."""
    if scaling.recipe.kind == "delayed":
        for operand, tensors in operands.items():
            for tensor in tensors:
                scaling.record(tensor, operand)
        return {operand: scaling.scales[operand].expand(len(tensors)) for operand, tensors in operands.items()}
    amaxes = {operand: torch.stack([scaling.amax(t) for t in tensors]) for operand, tensors in operands.items()}
    split = [operand for operand in amaxes if operand in scaling.split]
    if split and comm.group_size(scaling.group) > 1:
        joined = torch.cat([amaxes[operand] for operand in split])
        dist.all_reduce(joined, op=dist.ReduceOp.MAX, group=scaling.group)
        amaxes.update(zip(split, joined.split([len(amaxes[operand]) for operand in split])))
    return {operand: scaling.recipe.scale(amax, operand) for operand, amax in amaxes.items()}


def _ends(sizes: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' row counts and their cumulative sums (int32), copied without waiting for the device."""
    counts = to_device(torch.tensor(sizes, dtype=torch.int32), device)
    return counts, counts.cumsum(0, dtype=torch.int32)


def _products(scaling, rows, sizes, operand, scales, weights, weight_scales, transposed, one_gemm, biases=()):
    """Every expert's rows @ its weight (``transposed``: @ W, else @ W^T) (+ its bias), quantised with the given
    per-expert scales, in the rows' dtype: one grouped GEMM where asked (``one_gemm``) and the kernel takes them,
    else one GEMM per expert (the bias in its epilogue, as a linear's)."""
    recipe, cast, out_dtype = scaling.recipe, scaling.kernels.cast, rows.dtype
    oriented = [w.t() if transposed else w for w in weights]
    formats = recipe.dtype(operand), recipe.dtype(WEIGHT)
    if one_gemm and len(rows) and grouped_kernel.takes(out_dtype, rows.device, *formats):  # no rows: the loop
        counts, ends = _ends(sizes, rows.device)
        row_scales = scales.repeat_interleave(counts, output_size=len(rows))
        b = torch.stack([cast(w.detach(), s, E4M3) for w, s in zip(oriented, weight_scales)])
        out = grouped_kernel.product(cast(rows.detach(), row_scales[:, None], E4M3), row_scales, b, weight_scales,
                                     ends)
        if out is not None:
            for part, bias in zip(out.split(sizes), biases):
                part.add_(bias)
            return out
    out = rows.new_empty(len(rows), oriented[0].shape[0], dtype=out_dtype)
    start, biases = 0, list(biases) or [None] * len(weights)
    for part, scale, weight, weight_scale, bias in zip(rows.split(sizes), scales, oriented, weight_scales, biases):
        a = quantize_tensorwise(part, scale, recipe.dtype(operand), scaling.kernels)
        b = quantize_tensorwise(weight, weight_scale, recipe.dtype(WEIGHT), scaling.kernels)
        scaled_mm(a, b, out_dtype, out[start:start + len(part)], bias)
        start += len(part)
    return out


class Fp8GroupedLinear(torch.autograd.Function):
    """rows [n, in] grouped by expert (``sizes``) times each of the ``experts`` weights [out, in] (``params``),
    plus each one's bias where ``params`` go on with biases (already divided as the caller wants); ``one_gemm``:
    through the grouped kernel where it serves."""

    @staticmethod
    def forward(ctx, rows, sizes, scaling, one_gemm, experts, *params):
        weights, biases = params[:experts], params[experts:]
        scales = operand_scales(scaling, {INPUT: rows.split(sizes), WEIGHT: weights})
        out = _products(scaling, rows, sizes, INPUT, scales[INPUT], weights, scales[WEIGHT], False, one_gemm, biases)
        ctx.save_for_backward(rows, *weights)
        ctx.sizes, ctx.scaling, ctx.scales, ctx.biases, ctx.one_gemm = sizes, scaling, scales, len(biases), one_gemm
        ctx.gradients = (True, True)  # (input, weight); ``async_comm.gradient_pass`` narrows it
        ctx.grad_scales = None  # a split backward's W reuses I's
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, *weights = ctx.saved_tensors
        scaling, sizes, (inputs, weights_wanted) = ctx.scaling, ctx.sizes, ctx.gradients
        grad = grad.contiguous()
        grads = grad.split(sizes)
        if ctx.grad_scales is None:
            ctx.grad_scales = operand_scales(scaling, {GRAD: grads})[GRAD]
        grad_rows = None
        if inputs and ctx.needs_input_grad[0]:
            grad_rows = _products(scaling, grad, sizes, GRAD, ctx.grad_scales, weights, ctx.scales[WEIGHT], True,
                                  ctx.one_gemm)
        if not weights_wanted:  # I of a split backward: W computes these later
            return grad_rows, None, None, None, None, *[None] * (len(weights) + ctx.biases)
        scales = zip(ctx.scales[INPUT], ctx.scales[WEIGHT], ctx.grad_scales)
        grad_weights = [scaling.weight_grad(g, x, (sx, sw), sg, w.dtype)
                        for g, x, w, (sx, sw, sg) in zip(grads, rows.split(sizes), weights, scales)]
        grad_biases = [g.sum(0) for g in grads] if ctx.biases else []
        return grad_rows, None, None, None, None, *grad_weights, *grad_biases


def experts_linear(rows: torch.Tensor, sizes: list[int], linears: list, bias_divisor: int = 1,
                   one_gemm: bool = False) -> torch.Tensor:
    """Expert e's ``linears[e]`` on its ``sizes[e]`` rows, in FP8, as one step: [n, out]."""
    weights = [linear.weight for linear in linears]
    biases = [] if linears[0].bias is None else [linear.bias / bias_divisor for linear in linears]
    return Fp8GroupedLinear.apply(rows, sizes, linears[0].fp8, one_gemm, len(weights), *weights, *biases)

