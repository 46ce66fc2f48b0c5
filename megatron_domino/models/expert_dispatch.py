"""Expert parallelism: each token row travels to the rank that holds its expert, and its output comes back.

Expert-parallel rank j of ep holds experts [j * L, (j + 1) * L), L = num_experts / ep. One MoE forward:

1. **counts**: every rank tells every peer how many of its rows go to each of that peer's experts (an
   ``all_to_all_single`` of the router's int64 [E] device counts); its own counts and the arrived ones are
   read on the host in one sync: the sizes of the experts' GEMMs and of the next exchange.
2. **dispatch**: the rows, sorted by global expert, go out with ``all_to_all_single`` and variable splits.
   They arrive grouped by source rank, then by local expert; one host-computed permutation regroups them
   by local expert (each expert's rows: source 0's first, each source's in its token order).
3. **combine**: the experts' outputs, in that order, are permuted back and return by the reverse exchange.

Backward of an exchange is the exchange with the splits swapped. In an overlapped F&B unit
(``parallel.overlap_f_and_b``) each exchange of rows is a turn: the other half computes while the rows travel.
Every member of the group issues the same collectives in the same order (the pipeline schedule, the Domino order
and the turns are the same on every data-parallel rank), on device tensors, as NCCL requires. Without EP
(``group`` None) nothing moves.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import comm, turns


def _exchange(x: torch.Tensor, send: list[int], receive: list[int], group, hand_over) -> torch.Tensor:
    """The rows exchanged; ``hand_over`` runs while they travel (in an overlapped F&B unit, the other half's
    compute: ``parallel.turns``; elsewhere nothing)."""
    out, rows = x.new_empty((sum(receive),) + tuple(x.shape[1:])), x.contiguous()  # rows outlive the transfer
    work = dist.all_to_all_single(out, rows, receive, send, group=group, async_op=True)
    hand_over()
    work.wait()
    return out


class _AllToAll(torch.autograd.Function):
    """Rows [sum(send), ...] out, [sum(receive), ...] in; backward sends the gradients home."""

    @staticmethod
    def forward(ctx, x, send, receive, group, taking):
        ctx.send, ctx.receive, ctx.group, ctx.taking = send, receive, group, taking
        return _exchange(x, send, receive, group, lambda: turns.before_forward_wait(taking))

    @staticmethod
    def backward(ctx, grad):
        hand_over = lambda: turns.before_backward_wait(ctx.taking)  # noqa: E731
        return _exchange(grad, ctx.receive, ctx.send, ctx.group, hand_over), None, None, None, None


class ExpertExchange:
    """One routing group's token exchange over the expert-parallel ``group``, built from this rank's rows per
    global expert (``counts``, an int64 [E] device tensor; rows sorted by expert). After it: ``sizes``, the same
    on the host, and ``local_sizes``, rows per local expert after the dispatch."""

    def __init__(self, counts: torch.Tensor, group, turns=None):
        """``turns``: the run's ``parallel.turns.TurnTaking`` (the exchanges' waits hand over inside an F&B unit)."""
        self.group, self.turns, ep = group, turns, comm.group_size(group)
        local = len(counts) // ep
        if ep == 1:
            self.sizes = counts.tolist()  # the host sync that sizes each expert's GEMM
            self.send = self.receive = [sum(self.sizes)]
            self.local_sizes, self.order = self.sizes, None
            return
        arrived = torch.empty_like(counts)
        dist.all_to_all_single(arrived, counts, group=group)
        per_source = arrived.view(ep, local)
        host = torch.cat([counts, arrived]).tolist()  # one host sync sizes the GEMMs and the exchange
        self.sizes, arrived_rows = host[:len(counts)], host[len(counts):]
        self.send = [sum(self.sizes[j * local:(j + 1) * local]) for j in range(ep)]
        by_source = [arrived_rows[j * local:(j + 1) * local] for j in range(ep)]  # [source][local expert]
        self.receive = [sum(row) for row in by_source]
        self.local_sizes = [sum(row[e] for row in by_source) for e in range(local)]
        # arrived row k of segment (source j, expert e) -> position in segment (expert e, source j) order
        starts = (per_source.flatten().cumsum(0) - per_source.flatten()).view(ep, local).t().flatten()
        lengths = per_source.t().flatten()
        regrouped_starts = lengths.cumsum(0) - lengths
        total = sum(self.receive)
        device = counts.device
        self.order = (torch.arange(total, device=device)
                      + torch.repeat_interleave(starts - regrouped_starts, lengths, output_size=total))
        self.home = torch.empty_like(self.order)
        self.home[self.order] = torch.arange(total, device=device)

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows, sorted by global expert -> the rows its local experts received, grouped by expert
        (``local_sizes`` of each)."""
        if self.order is None:
            return rows
        return _AllToAll.apply(rows, self.send, self.receive, self.group, self.turns).index_select(0, self.order)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """The local experts' output rows, grouped as ``dispatch`` left them -> the outputs of this rank's rows,
        sorted by global expert."""
        if self.order is None:
            return rows
        return _AllToAll.apply(rows.index_select(0, self.home), self.receive, self.send, self.group, self.turns)
