"""The pipeline schedules as the planner models them: each one's bubble, activations in flight and held gradients,
read from its record (``pipeline/schedules/``, where each schedule's closed forms are stated), and the V's
per-chunk states.

Bubble, in micro-batch times of one rank (all its chunks' F, I and W); in flight, the (chunk-)micro-batches whose
activations a rank holds at its peak (from the F to the B, or to the W of a split backward); held gradients, the
chunk-micro-batches between their I and the end of their W (the gradients I records, ``held_gradients.py``).
For the split-backward schedules the most held falls at the activations' peak (the simulator's order), so the two
add exactly, except in DualPipeV, whose held peak falls in its cool-down, where pp + rank + 1 chunk-micro-batches
are alive, not 2pp + 1: which is why the memory estimate weighs a V's states (``v_states``) rather than adding
peaks.
"""
from __future__ import annotations

from functools import cache

from ..config.schema import Config
from ..pipeline.program import computes_of
from ..pipeline.schedules import build_schedule, get, schedule_kind


def pipeline_bubble(kind: str, pp: int, m: int, virtual_pp: int = 1) -> float:
    """The bubble of schedule ``kind`` in micro-batch times of one rank (its record's closed form)."""
    return get(kind).bubble(pp, m, virtual_pp)


def _schedule(cfg: Config, dp: int):
    pp, v = cfg.parallel.pp, cfg.parallel.virtual_pp
    return get(schedule_kind(pp, v, cfg.parallel.pipeline_schedule)), pp, cfg.train.num_microbatches(dp), v


def in_flight(cfg: Config, dp: int) -> list[int]:
    """Micro-batches (chunk-micro-batches with several chunks per rank) whose activations each pipeline rank holds at
    its peak."""
    schedule, pp, m, v = _schedule(cfg, dp)
    return schedule.in_flight(pp, m, v)


def held_gradients(cfg: Config, dp: int) -> list[int]:
    """Chunk-micro-batches whose I-recorded gradients each pipeline rank holds at its peak; 0 for schedules without
    a split backward."""
    schedule, pp, m, _ = _schedule(cfg, dp)
    return schedule.held_gradients(pp, m)


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
