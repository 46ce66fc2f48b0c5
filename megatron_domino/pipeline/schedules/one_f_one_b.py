"""1F1B (Narayanan et al. 2021, PipeDream-Flush): a warm-up of forwards, then one forward and one backward in turn.

Bubble (pp - 1) / (m + pp - 1) of a step: 3 (pp - 1) idle units of 3 a micro-batch (F 1, B 2), pp - 1 micro-batch
times. Rank r holds at most min(pp - r, m) micro-batches' activations: its warm-up's and the one in its turn.
"""
from __future__ import annotations

from . import register
from .record import Schedule, one_f_one_b_programs

ONE_F_ONE_B = register(Schedule(
    name="1f1b", label="1F1B", summary="warm-up forwards, then one forward and one backward in turn",
    build=one_f_one_b_programs, bubble=lambda pp, m, v: pp - 1.0,
    in_flight=lambda pp, m, v: [min(pp - rank, m) for rank in range(pp)], planner_default=True, order=1))
