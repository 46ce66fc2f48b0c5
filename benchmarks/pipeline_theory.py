"""What ``pipeline.py`` compares its measurements with, read from each schedule's record
(``megatron_domino/pipeline/schedules/``): the closed forms (bubble, peak activations in flight), whether a schedule
can run m micro-batches, and the in-flight count of a rank's recorded ops."""
from __future__ import annotations

from megatron_domino.pipeline.schedules import get, names

# name (parallel.pipeline_schedule) -> the chunks per rank it is measured with; the V schedules lay theirs out in a V
SCHEDULES = {name: get(name).picture_chunks for name in names()}
V_SHAPED = tuple(name for name in names() if get(name).v_shape)


def closed_form(schedule: str, m: int, pp: int) -> float:
    """The bubble's share of a step, equal stages and backward = 2 forwards (split evenly where split): b / (m + b),
    b the record's bubble in micro-batch times, e.g. (pp-1)/(m+pp-1) for 1F1B."""
    bubble = get(schedule).bubble(pp, m, SCHEDULES[schedule])
    return bubble / (m + bubble)


def closed_form_peak(schedule: str, m: int, pp: int) -> int:
    """Most chunk-micro-batches in flight on the busiest rank (the record's in-flight closed form)."""
    return max(get(schedule).in_flight(pp, m, SCHEDULES[schedule]))


def unmet(schedule: str, m: int, pp: int) -> str | None:
    """Why ``schedule`` cannot run m micro-batches on pp ranks (the library's own rule), or None."""
    from megatron_domino.config.checks import Checks
    from megatron_domino.pipeline.schedules import check_schedule
    checks = Checks()
    check_schedule(checks, pp, SCHEDULES[schedule], m, schedule)
    return "; ".join(problem.rule for problem in checks.problems) or None


def peak_in_flight(ops: list) -> int:
    """Most (chunk, micro-batch)s holding activations at once in one rank's ops (run in program order): from the F
    to the B, or to the W of a split backward."""
    alive, peak = 0, 0
    for op, *_ in ops:
        alive += 1 if op == "forward" else -1 if op in ("backward", "backward_weight") else 0
        peak = max(peak, alive)
    return peak
