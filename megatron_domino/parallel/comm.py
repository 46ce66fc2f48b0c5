"""Tensor-parallel communication as named autograd functions.

Every collective that model code issues goes through one of these, so a reader can point
at each all-reduce in a block. Conjugate pairs: copy <-> reduce, scatter <-> gather,
and for sequence parallelism all-gather <-> reduce-scatter along the sequence (dim 1,
activations are [batch, seq, hidden]).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

SEQUENCE_DIM = 1
def group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def group_rank(group) -> int:
    """This process's rank in ``group``; 0 without one (a group of one, or no torch.distributed)."""
    return dist.get_rank(group) if group_size(group) > 1 else 0


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    return x.chunk(size, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


# torch 2.13 renamed the flat collectives; older releases (>= 2.4 is supported) only have the old names.
# Looked up per call, so the strict mode's checks (parallel/strict.py) see them.
def all_gather_flat(output: torch.Tensor, input_: torch.Tensor, **kwargs):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, input_, **kwargs)


def reduce_scatter_flat(output: torch.Tensor, input_: torch.Tensor, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, input_, **kwargs)


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s/tp, h] on each rank -> [b, s, h]; gloo only gathers into a flat dim-0 output."""
    size = group_size(group)
    if size == 1:
        return x
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x.contiguous(), group=group)
    return torch.cat(out.chunk(size, dim=0), dim=SEQUENCE_DIM)


def reduce_scatter_sequence_async(x: torch.Tensor, group):
    """Start reducing [b, s, h] partial sums into this rank's [b, s/tp, h]; returns (output, work, input kept alive).

    The output is complete once ``work`` (None when nothing was sent) has been waited on.
    """
    size = group_size(group)
    if x.shape[SEQUENCE_DIM] % size:
        raise ValueError(f"sequence length {x.shape[SEQUENCE_DIM]} is not divisible by tp = {size} "
                         f"(sequence parallelism). Fix: make model.seq_length a multiple of parallel.tp.")
    stacked = torch.cat(x.chunk(size, dim=SEQUENCE_DIM), dim=0)
    if size == 1:
        return stacked, None, None
    out = torch.empty((x.shape[0],) + tuple(stacked.shape[1:]), dtype=x.dtype, device=x.device)
    return out, reduce_scatter_flat(out, stacked, group=group, async_op=True), stacked


def _reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s, h] partial sums -> this rank's [b, s/tp, h] of the total."""
    if group_size(group) == 1:
        return x
    out, work, _ = reduce_scatter_sequence_async(x, group)
    if work is not None:
        work.wait()
    return out


def _split_sequence(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    return x.chunk(size, dim=SEQUENCE_DIM)[dist.get_rank(group)].contiguous()


class CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient backward (entry of a column-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce forward; identity backward (exit of a row-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScatterToTensorParallel(torch.autograd.Function):
    """Keep this rank's slice of the last dim; gather gradients back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class GatherFromTensorParallel(torch.autograd.Function):
    """Concatenate the last dim over TP ranks; each rank keeps its gradient slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class GatherFromSequenceParallel(torch.autograd.Function):
    """All-gather along the sequence forward; reduce-scatter backward (entry of a TP region under SP)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad, ctx.group), None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather backward (exit of a TP region under SP)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_sequence(grad, ctx.group), None


class ScatterToSequenceParallel(torch.autograd.Function):
    """Keep this rank's sequence slice (after the embedding); gather gradients back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_sequence(grad, ctx.group), None


def _apply(function, x, group):
    """Run a TP communication function; with one TP rank every one of them is the identity."""
    return x if group_size(group) == 1 else function.apply(x, group)


def copy_to_tp(x, group):
    return _apply(CopyToTensorParallel, x, group)


def reduce_from_tp(x, group):
    return _apply(ReduceFromTensorParallel, x, group)


def scatter_to_tp(x, group):
    return _apply(ScatterToTensorParallel, x, group)


def gather_from_tp(x, group):
    return _apply(GatherFromTensorParallel, x, group)


def gather_from_sp(x, group):
    return _apply(GatherFromSequenceParallel, x, group)


def reduce_scatter_to_sp(x, group):
    return _apply(ReduceScatterToSequenceParallel, x, group)


def scatter_to_sp(x, group):
    return _apply(ScatterToSequenceParallel, x, group)
