"""The ZB-H1 schedule (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with the backward split in two.

I ("backward_input") computes the input gradient, which the previous stage waits for; W ("backward_weight")
computes the weight gradients, which nobody waits for. Sending I's result before doing W lets a gradient
cross the pipeline in the time of I alone, and held-back W's fill the cool-down where 1F1B idles.

Transfers are placed by the ideal timeline (``placement``): a send right after its compute, a receive at
the last point of the receiver's program that comes no later than the send, so neither side waits.

Bubble (pp - 1) / (3m + pp - 1): pp - 1 idle units of 3 a micro-batch, (pp - 1) / 3 micro-batch times; with
m < pp the cool-down lacks W's to fill it, pp - m units more. Every rank holds min(pp, m) micro-batches from F to
W (1F1B's rank-0 peak), and rank r >= 1 holds the gradients of min(r + 1, m) I's waiting for their W (rank r keeps
its W's r behind its I's, one more while a W runs); rank 0's backward runs as W and holds none.
"""
from __future__ import annotations

from collections import deque

from ..placement import place_transfers
from ..program import Instruction
from . import register
from .record import Schedule, one_f_one_b_programs


def zb_h1_order(pp: int, rank: int, num_microbatches: int) -> list[Instruction]:
    """Rank ``rank``'s computes: 1F1B's forwards and I's (warm-up of pp - rank - 1 forwards), W's kept
    ``rank`` behind the I's, then drained. A micro-batch holds its activations from F to W, so rank r holds
    at most (pp - r - 1) + 1 + r = pp of them: 1F1B's peak (rank 0's), as the paper's H1 requires. With
    uniform costs and m >= pp each rank idles (pp - 1)(F + I - W) of a makespan m(F + I + W) + (pp - 1)(F + I - W).
    """
    m = num_microbatches
    warmup = min(pp - rank - 1, m)
    order = [Instruction("forward", i) for i in range(warmup)]
    held: deque[int] = deque()
    for k in range(m):
        if warmup + k < m:
            order.append(Instruction("forward", warmup + k))
        order.append(Instruction("backward_input", k))
        held.append(k)
        if len(held) > rank:
            order.append(Instruction("backward_weight", held.popleft()))
    return order + [Instruction("backward_weight", k) for k in held]


def zb_h1_programs(pp: int, num_microbatches: int) -> list[list]:
    """Every rank's program: its ZB-H1 computes with the transfer groups placed by ``placement``."""
    return place_transfers([zb_h1_order(pp, rank, num_microbatches) for rank in range(pp)], 1)


def _build(pp: int, m: int, virtual_pp: int, forward_only: bool) -> list[list]:
    """Forward-only there is nothing to split: 1F1B's forwards."""
    return one_f_one_b_programs(pp, m, virtual_pp, True) if forward_only else zb_h1_programs(pp, m)


ZB_H1 = register(Schedule(
    name="zb-h1", label="ZB-H1", summary="1F1B with the backward split into I and W: about a third of its bubble",
    build=_build, bubble=lambda pp, m, v: (pp - 1 + max(0, pp - m)) / 3,
    in_flight=lambda pp, m, v: [min(pp, m)] * pp,
    held_gradients=lambda pp, m: [min(rank + 1, m) if rank else 0 for rank in range(pp)],
    regathers=lambda pp, m: 1.0, order=3))
