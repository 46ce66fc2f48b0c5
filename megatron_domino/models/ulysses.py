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
Every rank issues the same three all-to-alls (Q, K, V) and one back, in the same order: NCCL's rules. A
recomputed forward (``model.recompute``) repeats them: recompute saves no activation of attention, so the
exchange is paid twice (4 all-to-alls of this layer's Q, K, V and output per recomputed pass).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .ring_attention import local_positions


@dataclass(frozen=True)
class Ulysses:
    """This rank's all-to-all group and its size; the CP size, the group's first CP rank and the token layout's
    group size (``ring_attention.chunk_starts``'s ``a2a``): a2a uses the whole CP group and the ring's layout (1);
    a2a+ring a group of consecutive CP ranks, whose tokens together are one ring member's."""

    group: object
    size: int
    cp_size: int
    first: int = 0
    layout: int = 1


class _AllToAll(torch.autograd.Function):
    """[size, ...] -> [size, ...]: block j goes to rank j, block j of the result came from rank j."""

    @staticmethod
    def forward(ctx, blocks: torch.Tensor, group):
        ctx.group = group
        return _exchange(blocks, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group), None


def _exchange(blocks: torch.Tensor, group) -> torch.Tensor:
    blocks = blocks.contiguous()  # the collective reads and writes memory in order (empty_like keeps strides)
    out = torch.empty_like(blocks)
    dist.all_to_all_single(out, blocks, group=group)
    return out


def _members_order(ulysses: Ulysses, local: int, device) -> torch.Tensor:
    """The global positions of the group members' tokens laid end to end, the first member's first."""
    seq = local * ulysses.cp_size
    return torch.cat([local_positions(seq, ulysses.cp_size, ulysses.first + member, device, ulysses.layout)
                      for member in range(ulysses.size)])


def to_heads(x: torch.Tensor, ulysses: Ulysses) -> torch.Tensor:
    """[b, heads, s / cp, d] (this rank's chunks, every head) -> [b, heads / size, size · s / cp, d]: the group's
    tokens in sequence order (a2a: the whole sequence; a2a+ring: a ring member's two chunks), this rank's slice
    of the heads."""
    b, heads, local, d = x.shape
    size = ulysses.size
    blocks = x.view(b, size, heads // size, local, d).transpose(0, 1)  # [cp, b, heads / cp, s / cp, d]
    arrived = _AllToAll.apply(blocks, ulysses.group)  # block j: rank j's chunks of my heads
    joined = arrived.permute(1, 2, 0, 3, 4).reshape(b, heads // size, size * local, d)
    return joined.index_select(2, torch.argsort(_members_order(ulysses, local, x.device)))


def to_sequence(y: torch.Tensor, ulysses: Ulysses) -> torch.Tensor:
    """The inverse of ``to_heads``: [b, heads / size, size · s / cp, d] -> [b, heads, s / cp, d]."""
    b, heads, whole, d = y.shape
    size = ulysses.size
    local = whole // size
    order = torch.argsort(torch.argsort(_members_order(ulysses, local, y.device)))  # sorted -> members' order
    blocks = y.index_select(2, order).view(b, heads, size, local, d)
    arrived = _AllToAll.apply(blocks.permute(2, 0, 1, 3, 4), ulysses.group)  # block j: my chunks of j's heads
    return arrived.permute(1, 0, 2, 3, 4).reshape(b, size * heads, local, d)


def ulysses_attention(q, k, v, ulysses: Ulysses, core):
    """``core(q, k, v)`` (attention over whole sequences) on this rank's head slice; q [b, heads, s / cp, d],
    k and v [b, groups, s / cp, d]; returns [b, heads, s / cp, d]."""
    groups = k.shape[1]
    if groups % ulysses.size:  # fewer groups than ranks: a copy of each for every rank that reads it
        k = k.repeat_interleave(ulysses.size // groups, dim=1)
        v = v.repeat_interleave(ulysses.size // groups, dim=1)
    out = core(to_heads(q, ulysses), to_heads(k, ulysses), to_heads(v, ulysses))
    return to_sequence(out, ulysses)
