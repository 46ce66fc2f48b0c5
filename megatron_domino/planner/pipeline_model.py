"""The pipeline schedules as the planner models them: each one's bubble, activations in flight and held gradients,
read from its record (``pipeline/schedules/``, where each schedule's closed forms are stated), and the V's
per-chunk states.

Bubble, in micro-batch times of one rank (all its chunks' F, I and W); in flight, the (chunk-)micro-batches whose
activations a rank holds at its peak (from the F to the B, or to the W of a split backward); held gradients, the
chunk-micro-batches between their I and the end of their W (the gradients I records, ``held_gradients.py``).
For the split-backward schedules the most held falls at the activations' peak (the simulator's order), so the two
add exactly, except in DualPipeV, whose held peak falls in its cool-down, where pp + rank + 1 chunk-micro-batches
are alive, not 2pp + 1: which is why the memory estimate weighs the states of several chunks per rank
(``chunk_states``) rather than adding peaks.
"""
from __future__ import annotations

from functools import cache

from ..config.schema import Config
from ..pipeline.program import computes_of, virtual_stage
from ..pipeline.schedules import build_schedule, get, schedule_kind, v_shape


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
def chunk_states(kind: str, pp: int, m: int, v: int) -> tuple[frozenset, ...]:
    """Schedules with several chunks per rank (interleaved, the V's), per rank: every (alive per chunk, held per
    chunk, whether the loss's forward just ran) count of chunk-micro-batches its order passes through. A rank's
    chunks differ in size (the first stage's token ids and embedding, the last's head and logits), and the loss's
    softmax transient comes with the last stage's forwards only: sizing every chunk like the largest (``in_flight``
    x the largest chunk, plus the transient at the peak) overstated the V's rank 0 by a quarter and an interleaved
    last rank by half against rehearsals (its head's chunk holds few of the rank's chunk-micro-batches), and adding
    DualPipeV's peaks of activations and held gradients, which fall at different times, overstated every rank.
    ``chunks_peak`` weighs each state by the chunks' sizes. An F&B unit's forward counts before its backward frees
    (as ``in_flight`` assumes); the first stage (rank 0's chunk 0) holds no I-recorded gradients (its backward runs
    as W)."""
    result, last_stage = [], pp * v - 1
    for rank, program in enumerate(build_schedule(kind, pp, m, v)):
        alive, held, states = [0] * v, [0] * v, {(0,) * (2 * v + 1)}
        loss_chunk = next((c for c in range(v) if virtual_stage(rank, c, pp, v_shape(kind)) == last_stage), None)
        for step in program:
            for inst in computes_of(step):
                counted = rank > 0 or inst.chunk > 0
                alive[inst.chunk] += inst.op == "forward"
                alive[inst.chunk] -= inst.op in ("backward", "backward_weight")
                held[inst.chunk] += counted and inst.op == "backward_input"
                held[inst.chunk] -= counted and inst.op == "backward_weight"
                states.add((*alive, *held, int(inst.op == "forward" and inst.chunk == loss_chunk)))
        result.append(frozenset(states))
    return tuple(result)


def chunks_peak(states: frozenset, unit: list[float], held_unit: list[float], loss: float,
                other: float) -> tuple[float, float, float, int]:
    """(activation bytes, held-gradient bytes, transient bytes, chunk-micro-batches alive) at the state of
    ``chunk_states`` with the most bytes, ``unit`` and ``held_unit`` being each chunk's per chunk-micro-batch,
    ``loss`` the loss's transient (where its forward just ran) and ``other`` the transient that may come anywhere."""
    v = len(unit)

    def weighed(state):
        return (sum(a * u for a, u in zip(state[:v], unit)), sum(h * u for h, u in zip(state[v:2 * v], held_unit)),
                max(other, loss * state[-1]), sum(state[:v]))
    return max((weighed(state) for state in states), key=lambda w: w[0] + w[1] + w[2])
