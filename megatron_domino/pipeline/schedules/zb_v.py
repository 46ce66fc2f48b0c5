"""The ZB-V schedule (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): two model chunks per
rank in a V, the backward split into I and W, 1F1B's activation memory and almost no bubble.

Rank r holds stage r (chunk 0) and stage 2 pp - 1 - r (chunk 1): a micro-batch runs down the ranks and back
up, turning on rank pp - 1 without a transfer, and rank 0 both starts it and computes its loss. The order is
derived on the V's clock (``v_list``) by the paper's greedy rule under a memory cap: a free rank runs an I if
one is ready (chunk 0's first: it finishes a micro-batch's backward), else a forward while fewer than 2 pp
chunk-micro-batches are alive (chunk 1's first: it reaches the loss and frees memory sooner), else its oldest
held W. The I's keep the gradients crossing the V at the speed of I alone; the held W's fill every gap.

Held gradients (I done, W not yet) are counted on the order itself: a greedy rule has no closed form (pp / 2 to
3 pp / 2 at m >= 2 pp, up to 2 pp at m = pp); rank 0's chunk 0, the first stage, holds none (its backward runs
as W).
"""
from __future__ import annotations

from functools import cache

from ..placement import place_transfers
from ..v_list import v_orders
from . import register
from .record import Schedule, v_forwards


def _zb_v_choice(pp: int):
    def choose(rank, state, ready):
        for step in (ready("backward_input", 0), ready("backward_input", 1)):
            if step is not None:
                return step
        if state.alive < 2 * pp:
            for step in (ready("forward", 1), ready("forward", 0)):
                if step is not None:
                    return step
        held = [w for w in (ready("backward_weight", 0), ready("backward_weight", 1)) if w is not None]
        return min(held, key=lambda w: (w.microbatch, -w.chunk)) if held else None
    return choose


def zb_v_orders(pp: int, num_microbatches: int) -> list[list]:
    """Every rank's ZB-V computes (F, I, W of chunks 0 and 1)."""
    return v_orders(pp, num_microbatches, _zb_v_choice(pp))


def zb_v_programs(pp: int, num_microbatches: int) -> list[list]:
    """Every rank's ZB-V program, transfers placed by ``placement``; any m >= 1 runs, m >= pp is asked for.

    Closed forms, uniform costs F = I = W per chunk (the simulator's default F 1, B 2), m >= pp:
    - bubble (pp - 1) / (6 m + pp - 1): the least any V can have (rank r cannot start before r forwards, and
      each rank has 6 m units of work), about half of ZB-H1's (pp - 1) / (3 m + pp - 1);
    - peak in flight 2 pp chunk-micro-batches on every rank, each half a stage's layers: the activations of
      pp micro-batches, 1F1B's peak (its rank 0's).
    """
    return place_transfers(zb_v_orders(pp, num_microbatches), 2, v_shape=True)


@cache
def _held(pp: int, m: int) -> tuple[int, ...]:
    """Per rank, the most chunk-micro-batches of the order with I done and W not yet (rank 0's chunk 0 left out)."""
    peaks = []
    for rank, order in enumerate(zb_v_orders(pp, m)):
        held = peak = 0
        for inst in order:
            counted = rank > 0 or inst.chunk == 1
            held += counted and inst.op == "backward_input"
            peak = max(peak, held)
            held -= counted and inst.op == "backward_weight"
        peaks.append(peak)
    return tuple(peaks)


ZB_V = register(Schedule(
    name="zb-v", label="ZB-V", summary="2 chunks per rank in a V, the backward split: about half ZB-H1's bubble",
    build=lambda pp, m, v, forward_only: v_forwards(pp, m) if forward_only else zb_v_programs(pp, m),
    bubble=lambda pp, m, v: (pp - 1) / 6, in_flight=lambda pp, m, v: [min(2 * pp, 2 * m)] * pp,
    chunks=2, v_shape=True, least_per_pp=1, held_gradients=lambda pp, m: list(_held(pp, m)),
    regathers=lambda pp, m: 1.0, picture_chunks=2, order=4))
