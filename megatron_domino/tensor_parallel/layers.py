"""Column- and row-parallel linear layers (Megatron's split of Y = X A B across TP ranks).

A column-parallel layer holds a slice of A's output features; a row-parallel layer holds the
matching slice of B's input features and produces a partial sum that must be all-reduced
(or reduce-scattered under sequence parallelism). In Domino mode the layers expose the
asynchronous variants from ``domino.async_comm``; the block decides when to wait.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..domino.async_comm import PendingReduce, column_linear_async, row_linear_launch
from ..parallel import comm
from .sharding import ShardSpec, set_shard_spec


def make_param(shape, dtype, device, init: str, std: float = 0.0, spec: ShardSpec | None = None) -> nn.Parameter:
    """An uninitialised parameter that remembers how to initialise itself (see models.init)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    param.init_kind, param.init_std = init, std
    set_shard_spec(param, spec)
    return param


def column_parallel_linear(x, weight, bias, group, sequence_parallel: bool = False, grad_pieces: int = 0):
    """The column-parallel product with its TP entry: Domino async, SP all-gather, or Megatron's copy."""
    if grad_pieces > 0:
        return column_linear_async(x, weight, bias, group, grad_pieces, sequence_parallel)
    if sequence_parallel:
        return F.linear(comm.gather_from_sp(x, group), weight, bias)
    return F.linear(comm.copy_to_tp(x, group), weight, bias)


class ColumnParallelLinear(nn.Module):
    """Y_local = X A_local^T (+ b_local): this rank computes out_features / tp of the outputs.

    ``parts`` lists logically separate output blocks that are split individually (SwiGLU's
    gate and up). ``grad_pieces`` > 0 selects Domino's asynchronous input-gradient all-reduce
    (in that many column pieces); 0 is the synchronous Megatron path.
    """

    def __init__(self, in_features: int, out_features: int, group, *, parts: tuple[int, ...] | None = None,
                 bias: bool = True, gather_output: bool = False, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, grad_pieces: int = 0, init_std: float = 0.02,
                 dtype=torch.float32, device=None):
        super().__init__()
        self.group, self.tp = group, comm.group_size(group)
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel, self.grad_pieces = sequence_parallel, grad_pieces
        spec = ShardSpec(0, tuple(parts) if parts else (out_features,))
        if spec.full_size != out_features:
            raise ValueError(f"parts {parts} must add up to out_features {out_features}")
        local_out = spec.local_size(self.tp)
        self.weight = make_param((local_out, in_features), dtype, device, "normal", init_std, spec)
        self.bias = make_param((local_out,), dtype, device, "zeros", spec=ShardSpec(0, spec.parts)) if bias else None

    def forward(self, x: torch.Tensor):
        bias = None if self.skip_bias_add else self.bias
        out = column_parallel_linear(x, self.weight, bias, self.group, self.sequence_parallel, self.grad_pieces)
        if self.gather_output:
            out = comm.gather_from_tp(out, self.group)
        return (out, self.bias) if self.skip_bias_add else out


class RowParallelLinear(nn.Module):
    """Y = sum over TP ranks of X_local B_local^T, then + b (b replicated, added once).

    ``forward`` reduces synchronously (reduce-scatter under sequence parallelism) and returns
    (output, bias) so the caller can fuse bias, dropout and residual. ``launch`` is Domino's
    variant: it starts the all-reduce and returns a ``PendingReduce`` to wait on later.
    """

    def __init__(self, in_features: int, out_features: int, group, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, init_std: float = 0.02,
                 dtype=torch.float32, device=None):
        super().__init__()
        self.group, self.tp = group, comm.group_size(group)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        spec = ShardSpec(1, (in_features,))
        self.weight = make_param((out_features, spec.local_size(self.tp)), dtype, device, "normal", init_std, spec)
        self.bias = make_param((out_features,), dtype, device, "zeros") if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = comm.scatter_to_tp(x, self.group)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sp(partial, self.group), self.bias
        return comm.reduce_from_tp(partial, self.group), self.bias

    def launch(self, x: torch.Tensor, pieces: int = 1) -> tuple[PendingReduce, torch.Tensor | None]:
        """Domino: start the output all-reduce or SP reduce-scatter (in ``pieces`` column pieces); do not wait."""
        return row_linear_launch(x, self.weight, self.group, pieces, self.sequence_parallel), self.bias
