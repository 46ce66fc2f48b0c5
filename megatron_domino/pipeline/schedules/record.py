"""Everything the library knows about one pipeline schedule, in one record: adding a schedule is one new file in
this package that calls ``register`` with its ``Schedule``.

The config (names, the V's implied chunk count, its rules), the executor (the programs), the planner (bubble,
activations in flight, held gradients, ZeRO-3's extra gathers), the rehearsal and the dry run (micro-batch
counts), ``--print-schedule``, the pictures (``tools/draw_schedules.py``) and the pipeline benchmark all read
these fields and nothing else about a schedule.

Units: ``m`` micro-batches per step and DP rank, ``v`` model chunks per rank. The closed forms hold for uniform
stages with F : I : W = 1 : 1 : 1 per chunk (F 1, B 2: the simulator's defaults), which
``tests/test_planner.py`` and ``tests/test_pipeline_schedules.py`` hold them to.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..program import Instruction, add_transfers


def _one_microbatch(pp: int) -> int:
    return 1


def _nothing_held(pp: int, m: int) -> list[int]:
    return [0] * pp


def _no_regather(pp: int, m: int) -> float:
    return 0.0


@dataclass(frozen=True)
class Schedule:
    name: str  # parallel.pipeline_schedule ("none": no pipeline, gradient accumulation)
    label: str  # as the papers write it, for tables and pictures
    summary: str  # one line for people: what it does and what it costs
    build: Callable  # (pp, m, v, forward_only) -> every pipeline rank's program (``program``'s vocabulary)
    bubble: Callable  # (pp, m, v) -> idle micro-batch times of one rank (all its chunks' F, I and W)
    in_flight: Callable  # (pp, m, v) -> per rank, the most (chunk-)micro-batches holding activations at once
    chunks: int | None = 1  # model chunks per rank it runs: a fixed count, or None for any count >= 2
    v_shape: bool = False  # its 2 chunks laid out in a V (``program.virtual_stage``)
    least_per_pp: int = 0  # m must be at least least_per_pp * pp (0: one micro-batch will do)
    multiple_of_pp: bool = False  # m must be a multiple of pp (Megatron's interleaving)
    held_gradients: Callable = _nothing_held  # (pp, m) -> per rank, chunk-micro-batches whose I's gradient waits for W
    regathers: Callable = _no_regather  # (pp, m) -> ZeRO-3: share of backwards whose W gathers the weights again
    f_and_b_units: bool = False  # runs F&B units (``program.Overlapped``): parallel.overlap_f_and_b applies
    planner_default: bool = False  # tried by the planner when no schedule is asked for (its chunk count's default)
    picture_chunks: int = 1  # chunks per rank in its picture (docs/images)
    order: int = 100  # where it is listed (docs, errors, pictures): the order the schedules were published in

    def least_microbatches(self, pp: int) -> int:
        return max(1, self.least_per_pp * pp)

    def microbatch_step(self, pp: int) -> int:
        """m runs in steps of this (interleaving: pp)."""
        return pp if self.multiple_of_pp else 1

    def takes(self, virtual_pp: int) -> bool:
        """Whether it runs ``virtual_pp`` chunks per rank."""
        return virtual_pp == self.chunks if self.chunks is not None else virtual_pp >= 2


def one_forward_one_backward(forwards: list, backwards: list, warmup: int) -> list[list[Instruction]]:
    """Warm-up forwards, then iterations of one forward and one backward, then drain the backwards."""
    steady = len(forwards) - warmup
    iterations = [[f] for f in forwards[:warmup]]
    iterations += [[forwards[warmup + i], backwards[i]] for i in range(steady)]
    return iterations + [[b] for b in backwards[steady:]]


def programs(order, pp: int, virtual_pp: int, forward_only: bool) -> list[list]:
    """Each rank's computes (``order(rank)``, in iterations), the backwards dropped when ``forward_only``, with
    their transfer groups."""
    result = []
    for rank in range(pp):
        iterations = order(rank)
        if forward_only:
            iterations = [it for it in ([c for c in it if c.op == "forward"] for it in iterations) if it]
        result.append(add_transfers(iterations, rank, pp, virtual_pp))
    return result


def one_f_one_b_programs(pp: int, m: int, virtual_pp: int = 1, forward_only: bool = False) -> list[list]:
    """1F1B: a warm-up of min(pp - rank - 1, m) forwards, then one forward and one backward, then the cool-down;
    each output sent right after it is made (pp 1: F0 B0 F1 B1 ..., gradient accumulation)."""
    def order(rank: int) -> list[list[Instruction]]:
        fwd = [Instruction("forward", i) for i in range(m)]
        bwd = [Instruction("backward", i) for i in range(m)]
        return [[c] for it in one_forward_one_backward(fwd, bwd, min(pp - rank - 1, m)) for c in it]
    return programs(order, pp, virtual_pp, forward_only)


def v_forwards(pp: int, m: int) -> list[list]:
    """A V's forwards alone (evaluation): each rank runs chunk 0's, then chunk 1's, one group per compute."""
    def order(rank: int) -> list[list[Instruction]]:
        return [[Instruction("forward", k, c)] for c in (0, 1) for k in range(m)]
    return [add_transfers(order(rank), rank, pp, 2, v_shape=True) for rank in range(pp)]
