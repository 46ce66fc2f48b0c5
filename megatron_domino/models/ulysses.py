"""Ulysses context parallelism (``parallel.cp_comm: a2a``, DeepSpeed's sequence parallelism, Megatron's ``a2a``):
attention over a sequence split across the CP ranks by two all-to-alls instead of a ring.

A CP rank holds its two zig-zag chunks of the sequence (``ring_attention.local_positions``) for every head.
Before attention one all-to-all turns that into the whole sequence for 1/cp of the heads: the heads are cut
into cp slices, slice j goes to rank j, and the chunks that arrive are put back in sequence order. Attention
then runs unchanged on whole sequences (SDPA, causal or per packed document with the whole sequence's offsets;
any kernel). One all-to-all after it returns every head's output for this rank's chunks. The backward of an
all-to-all is the same exchange of the gradients, the other way.

``a2a+ring`` nests it: the all-to-all runs inside groups of consecutive CP ranks, whose tokens together are one
ring member's two chunks (``ring_attention.chunk_starts``), and ring attention runs across the groups on those
chunks of each member's head slice (``attention.context_parallel_attention`` composes the two).

Grouped-query K/V with fewer groups than cp ranks are repeated until there are cp of them (a rank's query
heads then all read their one group); the config requires the groups to divide cp or cp to divide them.
Overlap (``parallel.cp_a2a_slices``, ``ulysses_attention``): the heads are cut into slices run as a pipeline,
so one slice's all-to-alls fly while another's attention runs, forward and backward. Before that, the queries
go first (``QueriesInFlight``): ``models.attention`` projects them, starts slice 0's all-to-all and projects K
and V while it flies (``tensor_parallel.output_parts``: one linear's backward for both parts). Every rank issues
the same all-to-alls (slice 0's Q; its K and V; then Q, K and V per further slice; the outputs) in the same
order: NCCL's rules. With Domino, ``parallel.cp_a2a_output_overlap`` leaves the outputs' all-to-alls in flight
(``OutputInFlight``) while the next mu-chunk's attention runs (``domino.order``). A recomputed forward
(``model.recompute``) repeats the exchanges: full recompute all four per slice (it saves no activation of
attention); selective recompute, whose region starts after the queries arrived, K, V and the output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..domino.executor import sequence_mark, set_backward_priority
from .ring_attention import local_positions


@dataclass(frozen=True)
class Ulysses:
    """This rank's all-to-all group and its size; the CP size, the group's first CP rank and the token layout's
    group size (``ring_attention.chunk_starts``'s ``a2a``): a2a uses the whole CP group and the ring's layout (1);
    a2a+ring a group of consecutive CP ranks, whose tokens together are one ring member's. ``slices``: head
    slices pipelined (``parallel.cp_a2a_slices``), at most."""

    group: object
    size: int
    cp_size: int
    first: int = 0
    layout: int = 1
    slices: int = 1


class PendingExchange:
    """One all-to-all in flight: forward, ``_Launch`` starts it and ``_Wait`` (``wait``) is where the result is
    needed; backward, ``_Wait`` starts the gradient's exchange and ``_Launch`` waits for it, so whatever autograd
    runs between the two (another head slice's attention backward) overlaps it. NCCL: every member issues the
    exchanges in the same order, forward (program order) and backward (autograd's order, the same graph)."""

    def __init__(self, group):
        self.group, self.work, self.sent = group, None, None
        self.grad, self.grad_work, self.grad_sent = None, None, None

    def launch(self, blocks: torch.Tensor) -> torch.Tensor:
        return _Launch.apply(blocks, self)

    def wait(self, arriving: torch.Tensor) -> torch.Tensor:
        return _Wait.apply(arriving, self)


def _start(blocks: torch.Tensor, group):
    """(output, work, input kept alive): the input must outlive the transfer on the communication stream."""
    blocks = blocks.contiguous()  # the collective reads and writes memory in order (empty_like keeps strides)
    out = torch.empty_like(blocks)
    return out, dist.all_to_all_single(out, blocks, group=group, async_op=True), blocks


class _Launch(torch.autograd.Function):
    """[size, ...] -> [size, ...] (block j to rank j, block j of the result from rank j), still arriving."""

    @staticmethod
    def forward(ctx, blocks, pending: PendingExchange):
        ctx.pending = pending
        out, pending.work, pending.sent = _start(blocks, pending.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        pending = ctx.pending
        pending.grad_work.wait()
        arrived, pending.grad, pending.grad_work, pending.grad_sent = pending.grad, None, None, None
        return arrived, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, arriving, pending: PendingExchange):
        ctx.pending = pending
        pending.work.wait()
        pending.work = pending.sent = None
        return arriving.view_as(arriving)

    @staticmethod
    def backward(ctx, grad):
        pending = ctx.pending
        pending.grad, pending.grad_work, pending.grad_sent = _start(grad, pending.group)
        return pending.grad, None


def _orders(ulysses: Ulysses, local: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(members' order -> sequence order, and back): the indices that sort the group members' tokens, laid end to
    end (the first member's first), into sequence order, and the inverse. Made once per attention call."""
    seq = local * ulysses.cp_size
    held = torch.cat([local_positions(seq, ulysses.cp_size, ulysses.first + member, device, ulysses.layout)
                      for member in range(ulysses.size)])
    to_sequence_order = torch.argsort(held)
    return to_sequence_order, torch.argsort(to_sequence_order)


def _launch_to_heads(x: torch.Tensor, ulysses: Ulysses) -> tuple[PendingExchange, torch.Tensor]:
    b, heads, local, d = x.shape
    pending = PendingExchange(ulysses.group)
    return pending, pending.launch(x.view(b, ulysses.size, heads // ulysses.size, local, d).transpose(0, 1))


def _joined(pending: PendingExchange, arriving: torch.Tensor, to_sequence_order: torch.Tensor) -> torch.Tensor:
    """Block j (rank j's chunks of my heads) laid out in sequence order: [b, heads / size, size * local, d]."""
    size, b, heads, local, d = arriving.shape
    joined = pending.wait(arriving).permute(1, 2, 0, 3, 4).reshape(b, heads, size * local, d)
    return joined.index_select(2, to_sequence_order)


def _launch_to_sequence(y: torch.Tensor, ulysses: Ulysses,
                        to_members_order: torch.Tensor) -> tuple[PendingExchange, torch.Tensor]:
    b, heads, whole, d = y.shape
    size, local = ulysses.size, whole // ulysses.size
    blocks = y.index_select(2, to_members_order).view(b, heads, size, local, d)
    pending = PendingExchange(ulysses.group)
    return pending, pending.launch(blocks.permute(2, 0, 1, 3, 4))  # block j: my chunks of j's heads


def _split(pending: PendingExchange, arriving: torch.Tensor) -> torch.Tensor:
    size, b, heads, local, d = arriving.shape
    return pending.wait(arriving).permute(1, 0, 2, 3, 4).reshape(b, size * heads, local, d)


def to_heads(x: torch.Tensor, ulysses: Ulysses) -> torch.Tensor:
    """[b, heads, s / cp, d] (this rank's chunks, every head) -> [b, heads / size, size · s / cp, d]: the group's
    tokens in sequence order (a2a: the whole sequence; a2a+ring: a ring member's two chunks), this rank's slice
    of the heads."""
    return _joined(*_launch_to_heads(x, ulysses), _orders(ulysses, x.shape[2], x.device)[0])


def to_sequence(y: torch.Tensor, ulysses: Ulysses) -> torch.Tensor:
    """The inverse of ``to_heads``: [b, heads / size, size · s / cp, d] -> [b, heads, s / cp, d]."""
    return _split(*_launch_to_sequence(y, ulysses, _orders(ulysses, y.shape[2] // ulysses.size, y.device)[1]))


def head_slices(heads: int, groups: int, ulysses: Ulysses) -> int:
    """How many head slices to pipeline: the most, up to ``ulysses.slices``, that cut the query heads and the K/V
    groups alike into whole shares of every group member (one slice when the groups had to be repeated:
    ``groups`` counts them as they are before that)."""
    groups = groups if groups % ulysses.size == 0 else ulysses.size
    return max(n for n in range(1, ulysses.slices + 1) if heads % (n * ulysses.size) == 0
               and groups % (n * ulysses.size) == 0)


class QueriesInFlight:
    """The all-to-alls of q [b, heads, s / cp, d] (whose heads read ``groups`` K/V groups), one per head slice;
    ``ulysses_attention`` takes it as its ``q``. Slice 0's starts at once, before K and V exist; the others
    beside their slice's K and V, so that slice 0's attention waits for no more than it would with the queries
    made last (the wire carries one exchange after another)."""

    def __init__(self, q: torch.Tensor, groups: int, ulysses: Ulysses):
        self.ulysses, self.orders = ulysses, _orders(ulysses, q.shape[2], q.device)  # ulysses_attention's too
        self.slices = head_slices(q.shape[1], groups, ulysses)
        self.parts = list(q.chunk(self.slices, dim=1))
        self.launched: list[tuple | None] = [None] * self.slices
        self.joined: list[torch.Tensor | None] = [None] * self.slices
        self.early: set[int] = set()  # slices joined by ``arrive``, their priority not yet raised
        self.launch(0)

    def launch(self, i: int) -> None:
        """Start slice i's all-to-all, unless it has started."""
        if self.parts[i] is not None:
            self.launched[i], self.parts[i] = _launch_to_heads(self.parts[i], self.ulysses), None

    def slice(self, i: int) -> torch.Tensor:
        """Slice i's queries over the group's tokens in sequence order, waited for at the first call. Its
        autograd steps get the backward priority of the point where its attention runs (joined there, or, after
        ``arrive``, raised to it at the first call after), so that the slice's query gradient leaves as soon as
        its attention backward ran, as K's and V's do."""
        if self.joined[i] is None:
            self.launch(i)
            self.joined[i], self.launched[i] = _joined(*self.launched[i], self.orders[0]), None
        elif i in self.early:
            self.early.discard(i)
            set_backward_priority(_steps_back_to_wait(self.joined[i]), sequence_mark())
        return self.joined[i]

    def arrive(self) -> QueriesInFlight:
        """Every slice waited for now: for an attention core recomputed in backward (selective recompute), which
        must find the same queries when it runs again."""
        for i in range(self.slices):
            self.slice(i)
        self.early = set(range(self.slices))
        return self


class OutputInFlight:
    """The outputs' all-to-alls of ``ulysses_attention(..., in_flight=True)``, one per head slice, still in flight:
    Domino's attention core apart (``parallel.cp_a2a_output_overlap``) waits for them after the next μ-chunk's
    core ran. ``then`` shapes the arrived [b, heads, s / cp, d]."""

    def __init__(self, returning: list, then=lambda out: out):
        self.returning, self.then = returning, then

    @property
    def pieces(self) -> list[torch.Tensor]:
        """The arriving outputs (their autograd graph reaches back through the attention: Domino's executor
        looks for the projection's input-gradient waits there)."""
        return [arriving for _, arriving in self.returning]

    def wait(self) -> torch.Tensor:
        outs = [_split(*exchange) for exchange in self.returning]
        return self.then(outs[0] if len(outs) == 1 else torch.cat(outs, dim=1))


def _steps_back_to_wait(joined: torch.Tensor) -> list:
    """The autograd steps from a joined exchange's result back to its ``_Wait`` (the reorder, then the wait)."""
    steps, node = [], joined.grad_fn
    while node is not None:
        steps.append(node)
        if isinstance(node, _Wait._backward_cls):
            break
        node = node.next_functions[0][0]
    return steps


def ulysses_attention(q, k, v, ulysses: Ulysses, core, in_flight: bool = False):
    """``core(q, k, v)`` (attention over whole sequences) on this rank's head slice; q [b, heads, s / cp, d] (or
    already on its way: ``QueriesInFlight``), k and v [b, groups, s / cp, d]; returns [b, heads, s / cp, d].

    The heads are cut into slices (``head_slices``) run as a pipeline: slice i + 1's all-to-alls are in flight
    while slice i's attention runs, and slice i's output returns during slice i + 1's; backward, the gradients'
    exchanges overlap the other slice's attention backward the same way. One slice: nothing to overlap with but
    the exchanges themselves (Q, K and V in flight together). ``in_flight``: return the outputs' exchanges
    unwaited (``OutputInFlight``)."""
    arrived = isinstance(q, QueriesInFlight)
    n = q.slices if arrived else head_slices(q.shape[1], k.shape[1], ulysses)
    groups = k.shape[1]
    if groups % ulysses.size:  # fewer groups than ranks: a copy of each for every rank that reads it
        k = k.repeat_interleave(ulysses.size // groups, dim=1)
        v = v.repeat_interleave(ulysses.size // groups, dim=1)
    to_sequence_order, to_members_order = q.orders if arrived else _orders(ulysses, k.shape[2], k.device)
    parts = [x.chunk(n, dim=1) for x in ((k, v) if arrived else (q, k, v))]

    def launch(i: int) -> list:
        if arrived:
            q.launch(i)  # this slice's queries, beside its K and V (slice 0's left before K and V were made)
        return [_launch_to_heads(x[i], ulysses) for x in parts]
    launched, returning = [launch(0)], []
    for i in range(n):
        if i + 1 < n:
            launched.append(launch(i + 1))
        joined = [_joined(*exchange, to_sequence_order) for exchange in launched[i]]
        out = core(*([q.slice(i)] if arrived else []), *joined)
        returning.append(_launch_to_sequence(out, ulysses, to_members_order))
    arriving = OutputInFlight(returning)
    return arriving if in_flight else arriving.wait()
