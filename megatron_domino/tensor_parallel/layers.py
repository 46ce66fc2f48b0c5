"""Column- and row-parallel linear layers (Megatron's split of Y = X A B across TP ranks).

A column-parallel layer holds a slice of A's output features; a row-parallel layer holds the
matching slice of B's input features and produces a partial sum that must be all-reduced
(or reduce-scattered under sequence parallelism). In Domino mode the layers expose the
asynchronous variants from ``async_comm``; Domino's order decides when to wait.
"""
from __future__ import annotations

import torch
from torch import nn

from .async_comm import PendingReduce, column_linear_async, row_linear_launch
from ..fp8.linear import linear
from ..fp8.scaling import GRAD, INPUT, WEIGHT, LinearScaling
from ..parallel import comm
from .context import LayerContext
from .sharding import ParamInfo, ShardSpec, declare


def make_param(shape, ctx: LayerContext) -> nn.Parameter:
    """An uninitialised parameter on the context's device and dtype (``models.init`` fills it from the
    sharding table)."""
    return nn.Parameter(torch.empty(shape, dtype=ctx.dtype, device=ctx.device))


def fp8_scaling(ctx: LayerContext, split: tuple[int, ...]) -> LinearScaling | None:
    """A linear's FP8 scaling state under ``ctx.fp8`` (``split``: its operands that TP splits), else None."""
    return None if ctx.fp8 is None else LinearScaling(ctx.fp8, split, ctx.group, ctx.device)


def column_parallel_linear(x, weight, bias, ctx: LayerContext, fp8: LinearScaling | None = None):
    """The column-parallel product with its TP entry: Domino async, SP all-gather, or Megatron's copy."""
    if ctx.grad_pieces > 0:
        return column_linear_async(x, weight, bias, ctx.group, ctx.grad_pieces, ctx.sequence_parallel, fp8, ctx.turns)
    if ctx.sequence_parallel:
        return linear(comm.gather_from_sp(x, ctx.group), weight, bias, fp8)
    return linear(comm.copy_to_tp(x, ctx.group), weight, bias, fp8)


class ColumnParallelLinear(nn.Module):
    """Y_local = X A_local^T (+ b_local): this rank computes out_features / tp of the outputs.

    ``parts`` lists logically separate output blocks that are split individually (SwiGLU's
    gate and up). ``ctx.grad_pieces`` > 0 selects Domino's asynchronous input-gradient all-reduce
    (in that many column pieces); 0 is the synchronous Megatron path.
    """

    def __init__(self, in_features: int, out_features: int, ctx: LayerContext, *, parts: tuple[int, ...] | None = None,
                 bias: bool = True, gather_output: bool = False, skip_bias_add: bool = False,
                 init_std: float = 0.02):
        super().__init__()
        self.ctx, self.gather_output, self.skip_bias_add = ctx, gather_output, skip_bias_add
        spec = ShardSpec(0, tuple(parts) if parts else (out_features,))
        if spec.full_size != out_features:
            raise ValueError(f"parts {parts} must add up to out_features {out_features}")
        local_out = spec.local_size(ctx.size)
        declare(self, "weight", make_param((local_out, in_features), ctx),
                ParamInfo(spec, "normal", init_std, matrix=True))
        declare(self, "bias", make_param((local_out,), ctx) if bias else None,
                ParamInfo(ShardSpec(0, spec.parts), "zeros"))
        self.fp8 = fp8_scaling(ctx, (WEIGHT, GRAD))  # TP splits the weight's rows and the output's gradient

    def forward(self, x: torch.Tensor):
        bias = None if self.skip_bias_add else self.bias
        out = column_parallel_linear(x, self.weight, bias, self.ctx, self.fp8)
        if self.gather_output:
            out = comm.gather_from_tp(out, self.ctx.group)
        return (out, self.bias) if self.skip_bias_add else out


class RowParallelLinear(nn.Module):
    """Y = sum over TP ranks of X_local B_local^T, then + b (b replicated, added once).

    ``forward`` reduces synchronously (reduce-scatter under sequence parallelism) and returns
    (output, bias) so the caller can fuse bias, dropout and residual. ``launch`` is Domino's
    variant: it starts the all-reduce and returns a ``PendingReduce`` to wait on later.
    """

    def __init__(self, in_features: int, out_features: int, ctx: LayerContext, *, bias: bool = True,
                 input_is_parallel: bool = True, init_std: float = 0.02):
        super().__init__()
        self.ctx, self.input_is_parallel = ctx, input_is_parallel
        spec = ShardSpec(1, (in_features,))
        declare(self, "weight", make_param((out_features, spec.local_size(ctx.size)), ctx),
                ParamInfo(spec, "normal", init_std, matrix=True))
        # Under SP the bias is added to this rank's slice of the sequence only: its gradient sums over TP.
        declare(self, "bias", make_param((out_features,), ctx) if bias else None,
                ParamInfo(None, "zeros", grad_sums_over_tp=ctx.sequence_parallel))
        self.fp8 = fp8_scaling(ctx, (WEIGHT, INPUT))  # TP splits the weight's columns and the input

    def forward(self, x: torch.Tensor):
        group = self.ctx.group
        if not self.input_is_parallel:
            x = comm.scatter_to_tp(x, group)
        partial = linear(x, self.weight, None, self.fp8)
        if self.ctx.sequence_parallel:
            return comm.reduce_scatter_to_sp(partial, group), self.bias
        return comm.reduce_from_tp(partial, group), self.bias

    def launch(self, x: torch.Tensor, pieces: int = 1) -> tuple[PendingReduce, torch.Tensor | None]:
        """Domino: start the output all-reduce or SP reduce-scatter (in ``pieces`` column pieces); do not wait."""
        return row_linear_launch(x, self.weight, self.ctx.group, pieces, self.ctx.sequence_parallel,
                                 self.fp8), self.bias
