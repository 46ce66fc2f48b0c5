"""The asynchronous halves of tensor-parallel communication (what Domino overlaps), as named autograd steps.

Forward: ``launch_reduce`` starts the all-reduce of a row-parallel output and returns at once;
``PendingReduce.wait`` is the point where the next computation needs the sum.

Backward: a column-parallel linear launches the all-reduce of its input gradient, computes
its weight gradient while the reduction flies, and ``WaitForInputGradient`` (an identity in
forward, placed directly on the linear's input) waits just before the gradient is consumed.
Because that identity sits between the linear and everything else that reads the input, no
other branch (a residual, say) can be summed into the gradient before the wait: the
residual-branch hazard is impossible by construction.

On CUDA, NCCL runs async collectives on its own stream and ``work.wait()`` makes the compute
stream wait on an event, without blocking the host. On gloo the reduction runs on gloo's
thread. The same code serves both.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..fp8.linear import fp8_forward, linear, linear_backward
from ..parallel import comm, turns


@contextmanager
def gradient_pass(nodes, inputs: bool, weights: bool):
    """Within: the linear Functions among ``nodes`` (``LinearWithAsyncInputGradient``, ``fp8.linear.Fp8Linear``,
    the grouped experts': nodes with ``gradients``) compute input gradients only if ``inputs``, weight gradients
    only if ``weights`` (``pipeline.split_backward`` runs I and W under it). The engine skips a built-in node's
    unneeded outputs by itself but cannot tell a Python Function which of its outputs are needed, so the mode is
    set on the Function's own autograd node, which lives as long as it."""
    linears = [node for node in nodes if hasattr(node, "gradients")]
    saved = [node.gradients for node in linears]
    for node in linears:
        node.gradients = (inputs, weights)
    try:
        yield
    finally:
        for node, mode in zip(linears, saved):
            node.gradients = mode


class PendingReduce:
    """All-reduces (reduce-scatters along the sequence, under SP) in flight for one logical tensor,
    possibly in column pieces."""

    def __init__(self, pieces: list[torch.Tensor], group, sequence_parallel: bool = False):
        self.group, self.sequence_parallel = group, sequence_parallel
        self.pieces = pieces
        self.handles = [None] * len(pieces)
        self.keep_alive = [None] * len(pieces)  # a reduce-scatter's input must outlive the transfer

    def wait(self) -> torch.Tensor:
        """The reduced tensor; pieces are concatenated along the last dim."""
        waited = [_WaitReduce.apply(piece, self, i) for i, piece in enumerate(self.pieces)]
        return waited[0] if len(waited) == 1 else torch.cat(waited, dim=-1)


class _LaunchReduce(torch.autograd.Function):
    """Start an in-place all-reduce; identity in backward (the output gradient is replicated)."""

    @staticmethod
    def forward(ctx, x, pending: PendingReduce, index: int):
        if comm.group_size(pending.group) > 1:
            pending.handles[index] = dist.all_reduce(x, group=pending.group, async_op=True)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _LaunchReduceScatter(torch.autograd.Function):
    """Start reduce-scattering a partial along the sequence (SP); backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, pending: PendingReduce, index: int):
        ctx.group = pending.group
        out, pending.handles[index], pending.keep_alive[index] = comm.reduce_scatter_sequence_async(x, pending.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return comm.gather_sequence(grad, ctx.group), None, None


class _WaitReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pending: PendingReduce, index: int):
        handle = pending.handles[index]
        if handle is not None:
            handle.wait()
            pending.handles[index] = pending.keep_alive[index] = None
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def launch_reduce(partials, group, count: int = 1, sequence_parallel: bool = False) -> PendingReduce:
    """Launch the all-reduce (SP: reduce-scatter) of each partial as soon as it is computed; do not wait.

    ``partials`` may be a generator: piece i + 1 is then computed while piece i is reduced.
    """
    pending = PendingReduce([None] * count, group, sequence_parallel)
    launch = _LaunchReduceScatter if sequence_parallel and comm.group_size(group) > 1 else _LaunchReduce
    for index, partial in enumerate(partials):
        pending.pieces[index] = launch.apply(partial.contiguous(), pending, index)
    return pending


class PendingInputGradient:
    """The input gradient of one column-parallel linear, reduced asynchronously in ``pieces`` column pieces.

    Without SP each piece is all-reduced; under SP each is reduce-scattered to this rank's sequence slice.
    """

    def __init__(self, group, pieces: int, sequence_parallel: bool = False, turns=None):
        self.group, self.pieces, self.turns = group, pieces, turns
        self.sequence_parallel = sequence_parallel and comm.group_size(group) > 1
        self.work: list[tuple[torch.Tensor, slice, object, object]] = []
        self.grad: torch.Tensor | None = None

    def launch(self, products, in_features: int) -> torch.Tensor:
        """grad_input = grad_output @ weight (``products``: ``fp8.linear``'s backward products of the linear),
        computed and reduced piece by piece along the input features."""
        grad_output = products.grad_output
        communicate = comm.group_size(self.group) > 1
        if self.pieces <= 1 and not self.sequence_parallel:  # one piece, reduced in place
            self.grad = products.input_grad()
            handle = dist.all_reduce(self.grad, group=self.group, async_op=True) if communicate else None
            self.work.append((self.grad, slice(None), handle, None))
            return self.grad
        shape = list(grad_output.shape[:-1]) + [in_features]
        if self.sequence_parallel:
            shape[comm.SEQUENCE_DIM] //= comm.group_size(self.group)
        self.grad = grad_output.new_empty(shape)
        for columns in _column_slices(in_features, max(1, self.pieces)):
            piece = products.input_grad(columns)
            if self.sequence_parallel:
                out, handle, keep_alive = comm.reduce_scatter_sequence_async(piece, self.group)
                self.work.append((out, columns, handle, keep_alive))
            else:
                handle = dist.all_reduce(piece, group=self.group, async_op=True) if communicate else None
                self.work.append((piece, columns, handle, None))
        return self.grad

    def finish(self, grad: torch.Tensor) -> torch.Tensor:
        if grad.data_ptr() != self.grad.data_ptr():
            raise RuntimeError("Domino: the input gradient of a column-parallel linear was modified before its "
                               "all-reduce completed (a branch was summed in before the wait)")
        for piece, columns, handle, _ in self.work:
            if handle is not None:
                handle.wait()
            if piece is not self.grad:
                self.grad[..., columns] = piece
        result, self.work, self.grad = self.grad, [], None
        return result


def _column_slices(size: int, pieces: int) -> list[slice]:
    bounds = [size * i // pieces for i in range(pieces + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(pieces)]


class WaitForInputGradient(torch.autograd.Function):
    """Identity forward; backward waits for the linear's input-gradient all-reduce."""

    @staticmethod
    def forward(ctx, x, pending: PendingInputGradient):
        ctx.pending = pending
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        turns.before_backward_wait(ctx.pending.turns)  # in an overlapped F&B unit, the forward computes meanwhile
        return ctx.pending.finish(grad), None


class LinearWithAsyncInputGradient(torch.autograd.Function):
    """y = x W^T + b whose backward launches the input-gradient all-reduce before the weight gradient.

    Under SP, x is this rank's sequence slice: forward all-gathers it, and backward reduce-scatters.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, pending: PendingInputGradient, fp8=None):
        if pending.sequence_parallel:  # this rank's sequence slice -> the whole sequence
            x = comm.gather_sequence(x, pending.group)
        ctx.pending, ctx.has_bias, ctx.fp8, ctx.scales = pending, bias is not None, fp8, None
        ctx.gradients = (True, True)  # (input, weight); ``gradient_pass`` narrows it for a split backward
        if fp8 is None:
            ctx.save_for_backward(x, weight)
            return F.linear(x, weight, bias)
        out, ctx.scales, saved = fp8_forward(x, weight, bias, fp8)  # saved: x, or its FP8 transpose
        ctx.save_for_backward(saved, weight)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        launch = lambda products: ctx.pending.launch(products, products.weight.shape[1])  # noqa: E731
        return *linear_backward(ctx, grad_output, launch), None, None


def column_linear_async(x, weight, bias, group, pieces: int, sequence_parallel: bool = False, fp8=None, turns=None):
    """A column-parallel linear whose backward overlaps the input-gradient all-reduce with weight-gradient work
    (``fp8``: the linear's ``LinearScaling``, its products in FP8; ``turns``: the run's ``TurnTaking``)."""
    pending = PendingInputGradient(group, pieces, sequence_parallel, turns)
    return LinearWithAsyncInputGradient.apply(WaitForInputGradient.apply(x, pending), weight, bias, pending, fp8)


def row_linear_launch(x, weight, group, pieces: int, sequence_parallel: bool = False, fp8=None) -> PendingReduce:
    """A row-parallel linear whose output all-reduce (SP: reduce-scatter) is launched per column piece."""
    if pieces <= 1:
        return launch_reduce([linear(x, weight, None, fp8)], group, sequence_parallel=sequence_parallel)
    scale = None if fp8 is None else fp8.whole_weight_scale(weight)  # every piece quantised as the whole weight
    partials = (linear(x, weight[rows], None, fp8, scale) for rows in _column_slices(weight.shape[0], pieces))
    return launch_reduce(partials, group, count=pieces, sequence_parallel=sequence_parallel)
