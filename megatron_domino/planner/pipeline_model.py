"""The pipeline schedules as the planner models them: each one's bubble and its activations in flight.

Both are the schedules' closed forms (``pipeline/schedules.py``), which the simulator (``pipeline/simulate.py``)
confirms with uniform stages and F : I : W = 1 : 1 : 1 per chunk (F 1, B 2); ``tests/test_planner.py`` holds them
to it. m: micro-batches per step and DP rank; v: model chunks per rank.

Bubble, in micro-batch times of one rank (all its chunks' F, I and W): the closed form's idle units over one
micro-batch's units on a rank.
- 1F1B (pp - 1)/(m + pp - 1): 3 (pp - 1) idle of 3 a micro-batch, pp - 1 (Narayanan et al. 2021);
- interleaved (pp - 1)/(v m + pp - 1): 3 (pp - 1) of 3 v, (pp - 1)/v;
- ZB-H1 (pp - 1)/(3m + pp - 1): pp - 1 of 3, (pp - 1)/3; with m < pp the cool-down lacks W's to fill it, pp - m
  units more (the simulator's);
- ZB-V (pp - 1)/(6m + pp - 1), m >= pp: pp - 1 of 6 (two half-stage chunks), (pp - 1)/6;
- DualPipeV (7pp - 5)/(6m + 7pp - 5), m >= 2pp: (7pp - 5)/6, its F&B units credited no overlap (our executor
  runs the halves in sequence).

In flight: a rank holds the activations of every micro-batch whose forward has run and backward has not (a split
backward: until its W). 1F1B: min(pp - rank, m) on rank ``rank``; ZB-H1: min(pp, m) on every rank; interleaved:
Megatron's warm-up count + 1 chunk-micro-batches (``pipeline.schedules.interleaved_warmup``); on every rank of the
V, ZB-V 2pp chunk-micro-batches (pp micro-batches of whole stages, 1F1B's rank-0 peak) and DualPipeV 2pp + 1 (an
F&B unit's forward before its backward frees the other's), each at most 2m.

Held gradients: the most chunk-micro-batches between their I and the end of their W (the gradients I records,
``held_gradients.py``), stage 0's chunk left out (its whole backward runs as W). ZB-H1: min(rank + 1, m) on ranks
>= 1 (rank r keeps its W's r behind its I's, and holds one more while that W runs); ZB-V: counted on its order
(``zero_bubble_v``: a greedy rule under a memory cap, no closed form; pp/2 to 3pp/2 at m >= 2pp, up to 2pp at
m = pp); DualPipeV: 1 on rank 0 and 2 (rank + 1) on the others (its cool-down's r + 1 pairs I1 I0). For ZB-H1 and
ZB-V the most held falls at the activations' peak (the simulator's order), so the two add exactly; DualPipeV's
falls in its cool-down, where pp + rank + 1 chunk-micro-batches are alive, not 2pp + 1, which is why the memory
estimate weighs the V's states (``v_states``) rather than adding peaks.
"""
from __future__ import annotations

from functools import cache

from ..config.schema import Config
from ..pipeline.program import computes_of
from ..pipeline.schedules import build_schedule, interleaved_warmup, schedule_kind
from ..pipeline.zero_bubble_v import zb_v_orders


def pipeline_bubble(kind: str, pp: int, m: int, virtual_pp: int = 1) -> float:
    """The bubble of schedule ``kind`` in micro-batch times of one rank (all its chunks' F, I and W; see the module
    docstring): its closed form's idle units over one micro-batch's units on a rank."""
    if kind == "none":
        return 0.0
    if kind == "1f1b":  # F + B = 3 units per micro-batch, 3 (pp - 1) idle
        return pp - 1.0
    if kind == "interleaved":  # 3 v units per micro-batch, 3 (pp - 1) idle
        return (pp - 1) / virtual_pp
    if kind == "zb-h1":  # 3 units, pp - 1 idle; with m < pp the cool-down lacks W's: pp - m more
        return (pp - 1 + max(0, pp - m)) / 3
    if kind == "zb-v":  # 2 chunks x 3 units, pp - 1 idle (m >= pp)
        return (pp - 1) / 6
    if kind == "dualpipev":  # 6 units, 7 pp - 5 idle (m >= 2 pp; F&B credited no overlap)
        return (7 * pp - 5) / 6
    raise ValueError(f"unknown pipeline schedule {kind!r}")


def in_flight(cfg: Config, dp: int) -> list[int]:
    """Micro-batches (chunk-micro-batches with several chunks per rank) whose activations each pipeline rank holds at
    its peak (see the module docstring)."""
    pp, v = cfg.parallel.pp, cfg.parallel.virtual_pp
    m = cfg.train.num_microbatches(dp)
    kind = schedule_kind(pp, v, cfg.parallel.pipeline_schedule)
    if kind == "none":
        return [1]
    if kind == "1f1b":
        return [min(pp - rank, m) for rank in range(pp)]
    if kind == "zb-h1":  # each rank holds a micro-batch from F to W: 1F1B's peak, on every rank
        return [min(pp, m)] * pp
    if kind == "zb-v":  # 2 pp half-stages: pp micro-batches' worth, on every rank
        return [min(2 * pp, 2 * m)] * pp
    if kind == "dualpipev":  # an F&B unit holds its forward's before its backward frees the other's: one more
        return [min(2 * pp + 1, 2 * m)] * pp
    return [min(interleaved_warmup(pp, rank, m, v) + 1, m * v) for rank in range(pp)]


@cache
def _zb_v_held(pp: int, m: int) -> tuple[int, ...]:
    """Per rank, the most chunk-micro-batches of ZB-V's order with I done and W not yet (rank 0's chunk 0, the
    first stage, left out)."""
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


def held_gradients(cfg: Config, dp: int) -> list[int]:
    """Chunk-micro-batches whose I-recorded gradients each pipeline rank holds at its peak (module docstring); 0
    for schedules without a split backward."""
    pp, v = cfg.parallel.pp, cfg.parallel.virtual_pp
    m = cfg.train.num_microbatches(dp)
    kind = schedule_kind(pp, v, cfg.parallel.pipeline_schedule)
    if kind == "zb-h1":
        return [min(rank + 1, m) if rank else 0 for rank in range(pp)]
    if kind == "zb-v":
        return list(_zb_v_held(pp, m))
    if kind == "dualpipev":
        return [2 * (rank + 1) if rank else 1 for rank in range(pp)]
    return [0] * pp


@cache
def v_states(kind: str, pp: int, m: int) -> tuple[frozenset, ...]:
    """The V schedules (``zb-v``, ``dualpipev``), per rank: every (alive chunk 0, alive chunk 1, held chunk 0,
    held chunk 1) count of chunk-micro-batches its order passes through. Rank 0's two chunks are the first and
    the last stage, whose sizes differ (token ids and embedding against the head's logits): sizing all of them
    like the larger (``in_flight`` x the largest chunk) overstated rank 0 by a quarter against a rehearsal, and
    adding DualPipeV's peaks of activations and held gradients, which fall at different times, overstated every
    rank. ``v_peak`` weighs each state by the chunks' sizes. An F&B unit's forward counts before its backward
    frees (as ``in_flight`` assumes); rank 0's chunk 0 holds no I-recorded gradients (its backward runs as W)."""
    result = []
    for rank, program in enumerate(build_schedule(kind, pp, m, 2)):
        alive, held, states = [0, 0], [0, 0], {(0, 0, 0, 0)}
        for step in program:
            for inst in computes_of(step):
                counted = rank > 0 or inst.chunk == 1
                alive[inst.chunk] += inst.op == "forward"
                alive[inst.chunk] -= inst.op in ("backward", "backward_weight")
                held[inst.chunk] += counted and inst.op == "backward_input"
                held[inst.chunk] -= counted and inst.op == "backward_weight"
                states.add((*alive, *held))
        result.append(frozenset(states))
    return tuple(result)


def v_peak(states: frozenset, unit: list[float], held_unit: list[float]) -> tuple[float, float, int]:
    """(activation bytes, held-gradient bytes, chunk-micro-batches alive) at the state of ``v_states`` with the most
    bytes, ``unit`` and ``held_unit`` being each chunk's per chunk-micro-batch."""
    def weighed(state):
        return (state[0] * unit[0] + state[1] * unit[1], state[2] * held_unit[0] + state[3] * held_unit[1],
                state[0] + state[1])
    return max((weighed(state) for state in states), key=lambda w: w[0] + w[1])
