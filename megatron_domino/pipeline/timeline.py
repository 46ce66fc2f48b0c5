"""Text rendering of a simulated schedule, drawn like the pipeline papers' figures.

One row per rank, one fixed-width column per time unit; an op spanning several
units is one wide cell carrying its label ("F3", "B3", "F3.1" with chunks), and
"." marks an idle unit. Seeing the bubble is the quickest way to review a schedule.
"""
from __future__ import annotations

import math

from .simulate import SimulationResult


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
