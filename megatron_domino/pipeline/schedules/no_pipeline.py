"""No pipeline (pp 1): a step's micro-batches one after another, F0 B0 F1 B1 ... (gradient accumulation)."""
from __future__ import annotations

from . import register
from .record import Schedule, one_f_one_b_programs

NO_PIPELINE = register(Schedule(
    name="none", label="no pipeline", summary="pp 1: each micro-batch's forward then its backward",
    build=one_f_one_b_programs, bubble=lambda pp, m, v: 0.0, in_flight=lambda pp, m, v: [1], order=0))
