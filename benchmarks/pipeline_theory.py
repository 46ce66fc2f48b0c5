"""What ``pipeline.py`` compares its measurements with: each schedule's closed forms (bubble, peak activations in
flight), whether a schedule can run m micro-batches, and the in-flight count of a rank's recorded ops."""
from __future__ import annotations

# name (parallel.pipeline_schedule) -> virtual_pp; zb-v and dualpipev lay their 2 chunks out in a V
SCHEDULES = {"1f1b": 1, "interleaved": 2, "zb-h1": 1, "zb-v": 2, "dualpipev": 2}
V_SHAPED = ("zb-v", "dualpipev")


def closed_form(schedule: str, m: int, pp: int) -> float:
    """Equal stages, backward = 2 forwards (split evenly for ZB-H1 and the V): (pp-1)/(m+pp-1), (pp-1)/(v*m+pp-1)
    interleaved, (pp-1)/(3m+pp-1) ZB-H1 (m >= pp), (pp-1)/(6m+pp-1) ZB-V (m >= pp), (7pp-5)/(6m+7pp-5)
    DualPipeV (m >= 2 pp, an F&B unit costing F + B)."""
    v = SCHEDULES[schedule]
    if schedule == "zb-h1":
        return (pp - 1) / (3 * m + pp - 1)
    if schedule == "zb-v":
        return (pp - 1) / (6 * m + pp - 1)
    if schedule == "dualpipev":
        return (7 * pp - 5) / (6 * m + 7 * pp - 5)
    return (pp - 1) / (v * m + pp - 1)


def closed_form_peak(schedule: str, m: int, pp: int) -> int:
    """Most chunk-micro-batches in flight on the busiest rank: pp (rank 0) for 1F1B and ZB-H1, Megatron's warm-up
    + 1 interleaved, 2 pp for ZB-V and 2 pp + 1 for DualPipeV (every rank)."""
    v = SCHEDULES[schedule]
    if schedule in V_SHAPED:
        return 2 * pp + (schedule == "dualpipev")
    if schedule == "interleaved":
        return m * v if m == pp else min(2 * (pp - 1) + (v - 1) * pp + 1, m * v)
    return min(pp, m)


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
