"""A linear layer's product in FP8 (``model.fp8``) as an autograd step, and its backward's two products.

``linear`` is what every TP layer calls instead of ``F.linear``: unchanged without a ``LinearScaling``.
``Fp8Backward`` serves both this Function and Domino's ``LinearWithAsyncInputGradient``, which launches the
input gradient in column pieces before the weight gradient. Like that Function, this one carries ``gradients``
on its node, which a zero-bubble schedule's split backward narrows to the input or the weight half.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .quantize import scaled_mm
from .scaling import GRAD, INPUT, WEIGHT, LinearScaling


def fp8_forward(x, weight, bias, scaling: LinearScaling, weight_scale=None):
    """(x W^T + b with x and W quantised, the scales the backward reuses, what the backward keeps of x: x, or
    its FP8 transpose); delayed scaling's first step (``calibrating``) multiplies unquantised and records the
    amaxes."""
    if scaling.calibrating:
        scaling.record(x, INPUT)
        scaling.record(weight, WEIGHT)
        return F.linear(x, weight, bias), None, x
    qx, qw, scales, saved = scaling.forward_operands(x.reshape(-1, x.shape[-1]), weight, weight_scale)
    out = x.new_empty(*x.shape[:-1], weight.shape[0])  # written through a 2-D view: the output is no view
    scaled_mm(qx, qw, x.dtype, out.view(-1, weight.shape[0]), bias)
    return out, scales, saved


class Fp8Backward:
    """The two products of a linear's backward from one output gradient (quantised once, with its transpose).
    ``x``: what the forward kept (``fp8_forward``)."""

    def __init__(self, grad_output, x, weight, scaling: LinearScaling, scales):
        self.grad_output, self.x, self.weight, self.scaling, self.scales = grad_output, x, weight, scaling, scales
        self.grad = grad_output.reshape(-1, grad_output.shape[-1])
        self.grad_scale = scaling.grad_scale(self.grad)
        self.grads = None  # (g, g^T) quantised, once

    def _grads(self):
        if self.grads is None:
            self.grads = self.scaling.grad_operands(self.grad, self.grad_scale)
        return self.grads

    def input_grad(self, columns=slice(None)) -> torch.Tensor:
        """dx[..., columns]; g is quantised at the first call and shared by every column piece."""
        weight_t = self.scaling.weight_operand(self.weight, self.scales[1] if self.scales else None, transposed=True)
        out = scaled_mm(self._grads()[0], weight_t.rows(columns), self.grad.dtype)
        return out.view(*self.grad_output.shape[:-1], out.shape[-1])

    def weight_grad(self) -> torch.Tensor:
        x = self.x if self.x.dim() == 2 else self.x.reshape(-1, self.x.shape[-1])
        gt = None if self.scaling.recipe.kind == "blockwise" else self._grads()[1]
        return self.scaling.weight_grad(self.grad, x, self.scales, self.grad_scale, self.weight.dtype, gt)


class PlainBackward:
    """The same two products in the weights' dtype (no FP8)."""

    def __init__(self, grad_output, x, weight, scaling=None, scales=None):
        self.grad_output, self.x, self.weight = grad_output, x, weight

    def input_grad(self, columns=slice(None)) -> torch.Tensor:
        return self.grad_output.matmul(self.weight[:, columns])

    def weight_grad(self) -> torch.Tensor:
        flat = self.grad_output.reshape(-1, self.grad_output.shape[-1])
        return flat.t().matmul(self.x.reshape(-1, self.x.shape[-1]))


def backward_products(grad_output, x, weight, scaling, scales):
    if scaling is not None and scaling.calibrating:  # delayed scaling's first step: record, multiply unquantised
        scaling.record(grad_output, GRAD)
        scaling = None
    return (PlainBackward if scaling is None else Fp8Backward)(grad_output, x, weight, scaling, scales)


def linear_backward(ctx, grad_output, input_grad) -> tuple:
    """(dx, dW, db) of a linear Function (this one, or Domino's) from its saved x and W: ``input_grad(products)``
    makes dx; ``ctx.gradients`` (input, weight) says which half a zero-bubble split backward wants now."""
    x, weight = ctx.saved_tensors
    inputs, weights = ctx.gradients
    products = backward_products(grad_output, x, weight, ctx.fp8, ctx.scales)
    grad_input = input_grad(products) if inputs else None
    if not weights:  # I of a split backward: W computes these later
        return grad_input, None, None
    grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if ctx.has_bias else None
    return grad_input, products.weight_grad(), grad_bias


class Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, scaling: LinearScaling, weight_scale):
        out, ctx.scales, saved = fp8_forward(x, weight, bias, scaling, weight_scale)
        ctx.save_for_backward(saved, weight)
        ctx.fp8, ctx.has_bias = scaling, bias is not None
        ctx.gradients = (True, True)  # (input, weight); ``async_comm.gradient_pass`` narrows it
        return out

    @staticmethod
    def backward(ctx, grad_output):
        needed = ctx.needs_input_grad[0]
        input_grad = lambda products: products.input_grad() if needed else None  # noqa: E731
        return *linear_backward(ctx, grad_output, input_grad), None, None


def linear(x, weight, bias=None, scaling: LinearScaling | None = None, weight_scale=None):
    """x W^T + b, in FP8 when the layer has a ``scaling`` (``weight_scale``: a Domino piece's whole-weight scale)."""
    if scaling is None:
        return F.linear(x, weight, bias)
    return Fp8Linear.apply(x, weight, bias, scaling, weight_scale)
