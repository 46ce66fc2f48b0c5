"""Text rendering of a simulated schedule, drawn like the pipeline papers' figures (``--print-schedule``,
``tools/print_schedule.py``).

One row per rank, one fixed-width column per time unit; an op spanning several
units is one wide cell carrying its label ("F3", "B3", "F3.1" with chunks), and
"." marks an idle unit. Seeing the bubble is the quickest way to review a schedule.
"""
from __future__ import annotations

import math
import sys

from .schedules import schedule_for, v_shape
from .simulate import Costs, ScheduleError, SimulationResult, simulate


def render_timeline(result: SimulationResult, unit: float | None = None) -> str:
    """Rows "rank r | F0 F1 .  B0    ..." for ``result``; ``unit`` defaults to the shortest op.

    Op boundaries are rounded to the nearest unit, so costs that are not multiples of ``unit`` render approximately.
    """
    durations = [s.end - s.start for row in result.spans for s in row if s.end > s.start]
    if unit is None:
        unit = min(durations) if durations else 1.0
    if unit <= 0:
        raise ValueError(f"timeline unit = {unit} must be > 0; fix: pass a positive unit or leave it None")
    show_chunk = result.virtual_pp > 1
    width = 1 + max((len(s.instruction.label(show_chunk)) for row in result.spans for s in row), default=1)
    columns = math.ceil(result.makespan / unit - 1e-9)
    rank_width = len(str(result.pp - 1))
    lines = []
    for rank, row in enumerate(result.spans):
        cells, col = [], 0
        for span in row:
            start = max(col, round(span.start / unit))
            end = max(start + 1, round(span.end / unit))
            cells += [".".ljust(width)] * (start - col)
            cells.append(span.instruction.label(show_chunk).ljust((end - start) * width))
            col = end
        cells += [".".ljust(width)] * (columns - col)
        lines.append(f"rank {rank:>{rank_width}} | {''.join(cells).rstrip()}")
    return "\n".join(lines)


def summarize(result: SimulationResult) -> str:
    """Per-rank busy/idle time, idle fraction and peak in-flight micro-batches, then the overall bubble."""
    rank_width = len(str(result.pp - 1))
    lines = [f"rank {r:>{rank_width}} : busy {result.busy[r]:g}  idle {result.idle[r]:g}  "
             f"idle fraction {result.idle_fraction[r]:.4f}  max in flight {result.max_in_flight[r]}"
             for r in range(result.pp)]
    lines.append(f"makespan {result.makespan:g}  bubble fraction {result.bubble_fraction:.4f}")
    return "\n".join(lines)


def show_run(parallel, num_microbatches: int) -> int:
    """``--print-schedule``: the schedule a run with these settings executes (``schedules.schedule_for``)."""
    try:
        kind, schedule = schedule_for(parallel, num_microbatches)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return show(kind, schedule, num_microbatches, parallel.virtual_pp, Costs(), ops=False)


def show(kind: str, schedule: list[list], num_microbatches: int, virtual_pp: int, costs: Costs, ops: bool) -> int:
    """Print the schedule's timeline, per-rank summary and (``ops``) instruction lists; 2 if it cannot run."""
    try:
        result = simulate(schedule, num_microbatches, virtual_pp, costs, v_shape=v_shape(kind))
    except ScheduleError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{kind}: pp={len(schedule)} microbatches={num_microbatches} virtual_pp={virtual_pp} "
          f"forward={costs.forward:g} backward={costs.backward:g} comm={costs.comm:g}")
    print(render_timeline(result))
    print(summarize(result))
    if ops:
        for rank, program in enumerate(schedule):
            print(f"rank {rank} ops: " + " ".join(inst.label(virtual_pp > 1) for inst in program))
    return 0
