"""How long each compute of a rank's pipeline program took, and the job's step predicted from those times.

A timed rank plays its own program with its receives completing one link time after they are posted (the
sender assumed on time), so it never waits for a neighbour the way a real pipeline does. Its measured F, B, I
and W times per virtual stage (medians over the step's micro-batches) go into ``pipeline.simulate`` for the
job's schedule and micro-batch count, which puts the bubble back: the predicted step is the simulated span plus
what the rank spends outside the pipeline program (gradient reduction, optimizer step), measured. A compute's
time includes waiting for the receive it consumes, so the simulation adds no separate transfer time. Stages
that were not rehearsed take the times of the nearest rehearsed pipeline rank's stage of the same chunk. An
F&B unit (DualPipeV) is timed as a whole and split between its halves in proportion to their times alone.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

from ..parallel.device import cuda
from ..pipeline.program import Overlapped, TransferGroup, virtual_stage
from ..pipeline.schedules import build_schedule, schedule_kind, v_shape
from ..pipeline.simulate import Costs, simulate

OPS = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}


class InstructionTimes:
    """The executor's ``step_timer``: seconds per compute step, by (op letter, virtual stage)."""

    def __init__(self, device, pp_rank: int, pp: int, v_shaped: bool):
        self.on_cuda = device.type == "cuda"
        self.pp_rank, self.pp, self.v_shaped = pp_rank, pp, v_shaped
        self.seconds: dict = {}  # (op, stage) -> [seconds, ...]
        self._units: list = []  # (unit, seconds) of F&B units, split once the halves' times are known
        self._pending: list = []
        self.program_seconds = 0.0  # every step of the program, transfers included, since ``take_program``
        self.recording = False

    def _stage(self, chunk: int) -> int:
        return virtual_stage(self.pp_rank, chunk, self.pp, self.v_shaped)

    @contextmanager
    def __call__(self, step):
        if not self.recording:
            yield
            return
        if self.on_cuda:
            start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((step, start, end))
        else:
            begin = time.perf_counter()
            yield
            self._add(step, time.perf_counter() - begin)

    def _add(self, step, seconds: float) -> None:
        self.program_seconds += seconds
        if isinstance(step, TransferGroup):
            return
        if isinstance(step, Overlapped):
            self._units.append((step, seconds))
        else:
            self.seconds.setdefault((OPS[step.op], self._stage(step.chunk)), []).append(seconds)

    def settle(self) -> None:
        """Read the CUDA events of the steps timed so far (synchronise first)."""
        for step, start, end in self._pending:
            self._add(step, start.elapsed_time(end) / 1e3)
        self._pending = []

    def take_program(self) -> float:
        """Seconds spent in the pipeline program since the last call (settled)."""
        self.settle()
        seconds, self.program_seconds = self.program_seconds, 0.0
        return seconds

    def medians(self) -> dict:
        """(op, stage) -> median seconds, F&B units shared out between their halves."""
        self.settle()
        alone = {key: statistics.median(values) for key, values in self.seconds.items()}
        shared: dict = {}
        for unit, seconds in self._units:
            keys = [(OPS[half.op], self._stage(half.chunk)) for half in unit.halves]
            weights = [alone.get(key, 1.0) for key in keys]
            for key, weight in zip(keys, weights):
                shared.setdefault(key, []).append(seconds * weight / sum(weights))
        for key, values in shared.items():
            alone.setdefault(key, statistics.median(values))
        return alone


def stage_costs(measured: dict, pp: int, virtual_pp: int, v_shaped: bool) -> Costs:
    """Per-virtual-stage ``Costs`` from the roles' medians (``measured``: pp rank -> ``InstructionTimes.medians``),
    the unmeasured pipeline ranks borrowing from the nearest measured one."""
    forward, backward, weight = [], [], []
    for stage in range(pp * virtual_pp):
        rank, chunk = _rank_and_chunk(stage, pp, v_shaped)
        nearest = min(measured, key=lambda r: (abs(r - rank), r))
        times = measured[nearest]
        own = virtual_stage(nearest, chunk, pp, v_shaped)
        f = times.get(("F", own), 0.0)
        w = times.get(("W", own))
        b = times.get(("B", own), times.get(("I", own), 0.0) + (w or 0.0))
        forward.append(f)
        backward.append(b)
        weight.append(w if w is not None else b / 2)
    return Costs(forward=forward, backward=backward, weight=weight)


def _rank_and_chunk(stage: int, pp: int, v_shaped: bool) -> tuple[int, int]:
    if v_shaped:
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


def predict_step(parallel, num_microbatches: int, measured: dict, outside: float) -> float:
    """The job's step: ``simulate`` of its schedule with the measured costs, plus ``outside`` seconds."""
    kind = schedule_kind(parallel.pp, parallel.virtual_pp, parallel.pipeline_schedule)
    virtual_pp = parallel.virtual_pp
    schedule = build_schedule(kind, parallel.pp, num_microbatches, virtual_pp)
    costs = stage_costs(measured, parallel.pp, virtual_pp, v_shape(kind))
    return simulate(schedule, num_microbatches, virtual_pp, costs, v_shape=v_shape(kind)).makespan + outside
