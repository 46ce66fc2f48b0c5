"""Discrete-event simulation of a pipeline schedule, without processes.

Runs every rank's instruction list in order under the executor's semantics
(sends are non-blocking, receives block until the matching send has happened
plus the transfer cost) and proves, before any GPU is touched, that a schedule
is well formed, FIFO-consistent on every channel, deadlock-free, and how much
of the step is bubble.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Sequence, Union

from .schedules import Instruction, virtual_stage, with_transfers

Cost = Union[float, Sequence[float]]


class ScheduleError(ValueError):
    """A schedule that the executor could not run: malformed, mismatched transfers or deadlock."""


@dataclass(frozen=True)
class Costs:
    """Time of each op. ``forward``/``backward`` are one number or one per virtual stage (uneven partitions)."""

    forward: Cost = 1.0
    backward: Cost = 2.0
    comm: float = 0.0  # latency from a send until the matching receive can complete

    def of(self, inst: Instruction, stage: int) -> float:
        cost = self.forward if inst.op == "forward" else self.backward
        return float(cost) if isinstance(cost, (int, float)) else float(cost[stage])


@dataclass(frozen=True)
class Span:
    """One compute op as it ran: [start, end)."""

    instruction: Instruction
    start: float
    end: float


@dataclass
class SimulationResult:
    pp: int
    virtual_pp: int
    num_microbatches: int
    spans: list[list[Span]]  # per rank, compute ops in execution order
    makespan: float  # end of the last op; every rank starts at 0
    max_in_flight: list[int]  # per rank: most chunk-micro-batches with forward done and backward not yet
    busy: list[float] = field(init=False)
    idle: list[float] = field(init=False)

    def __post_init__(self):
        self.busy = [sum(s.end - s.start for s in row) for row in self.spans]
        self.idle = [self.makespan - b for b in self.busy]

    @property
    def idle_fraction(self) -> list[float]:
        return [i / self.makespan if self.makespan else 0.0 for i in self.idle]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time together."""
        return sum(self.idle) / (self.pp * self.makespan) if self.makespan else 0.0


def _name(inst: Instruction, virtual_pp: int) -> str:
    return inst.label(virtual_pp > 1)


def check_structure(schedule: list[list[Instruction]], num_microbatches: int, virtual_pp: int = 1) -> None:
    """Each rank runs every (chunk, micro-batch) forward then backward exactly once, with transfers adjacent."""
    pp, stages = len(schedule), len(schedule) * virtual_pp
    expected_units = {(c, mb) for c in range(virtual_pp) for mb in range(num_microbatches)}
    for rank, program in enumerate(schedule):
        computes = [inst for inst in program if inst.is_compute]
        for inst in computes:
            if not (0 <= inst.chunk < virtual_pp and 0 <= inst.microbatch < num_microbatches):
                raise ScheduleError(f"rank {rank}: {_name(inst, virtual_pp)} is outside chunk 0..{virtual_pp - 1} "
                                    f"or micro-batch 0..{num_microbatches - 1}")
        for op in ("forward", "backward"):
            units = [(i.chunk, i.microbatch) for i in computes if i.op == op]
            if len(units) != len(set(units)) or set(units) != expected_units:
                missing = sorted(expected_units - set(units))
                repeated = sorted({u for u in units if units.count(u) > 1})
                raise ScheduleError(f"rank {rank}: every (chunk, micro-batch) must run {op} exactly once; "
                                    f"missing {missing}, repeated {repeated}")
        done = set()
        for inst in computes:
            unit = (inst.chunk, inst.microbatch)
            if inst.op == "backward" and unit not in done:
                raise ScheduleError(f"rank {rank}: {_name(inst, virtual_pp)} runs before its forward")
            done.add(unit)
        wanted = [t for inst in computes for t in with_transfers(inst, virtual_stage(rank, inst.chunk, pp), stages)]
        for i, (have, want) in enumerate(zip(list(program) + [None], wanted + [None])):
            if have != want:
                got = _name(have, virtual_pp) if have else "end of list"
                need = _name(want, virtual_pp) if want else "end of list"
                raise ScheduleError(f"rank {rank}, instruction {i}: found {got} but expected {need}; each receive "
                                    f"must come right before the compute that consumes it and each send right after "
                                    f"the compute that produces it (none on the first/last virtual stage)")


def _peer(inst: Instruction, rank: int, pp: int) -> tuple[str, int, int]:
    """(direction, peer virtual stage, this virtual stage) of a transfer."""
    stage = virtual_stage(rank, inst.chunk, pp)
    forward = inst.op.endswith("forward")
    sending = inst.op.startswith("send")
    peer = stage + 1 if forward == sending else stage - 1
    return ("activation" if forward else "gradient"), peer, stage


def _max_in_flight(program: list[Instruction]) -> int:
    alive = peak = 0
    for inst in program:
        alive += {"forward": 1, "backward": -1}.get(inst.op, 0)
        peak = max(peak, alive)
    return peak


def simulate(schedule: list[list[Instruction]], num_microbatches: int, virtual_pp: int = 1,
             costs: Costs = Costs(), channels: str = "per_kind") -> SimulationResult:
    """Run ``schedule`` and return per-rank op times; raise ScheduleError if the executor would fail.

    ``channels``: "per_kind" matches transfers in FIFO order per (src, dst, activation|gradient), which is what
    the executor guarantees; "per_pair" matches per (src, dst) only, as one untagged NCCL stream would.
    """
    if channels not in ("per_kind", "per_pair"):
        raise ValueError(f"channels = {channels!r} must be 'per_kind' or 'per_pair'")
    if not schedule:
        raise ScheduleError("the schedule has no ranks; fix: pass one instruction list per pipeline rank")
    check_structure(schedule, num_microbatches, virtual_pp)
    pp = len(schedule)
    queues: dict[tuple, deque] = defaultdict(deque)
    pc, clock = [0] * pp, [0.0] * pp
    spans: list[list[Span]] = [[] for _ in range(pp)]
    progress = True
    while progress:
        progress = False
        for rank, program in enumerate(schedule):
            while pc[rank] < len(program):
                inst = program[pc[rank]]
                if inst.is_compute:
                    start = clock[rank]
                    clock[rank] = start + costs.of(inst, virtual_stage(rank, inst.chunk, pp))
                    spans[rank].append(Span(inst, start, clock[rank]))
                else:
                    kind, peer, stage = _peer(inst, rank, pp)
                    src, dst = (rank, peer % pp) if inst.op.startswith("send") else (peer % pp, rank)
                    key = (src, dst) if channels == "per_pair" else (src, dst, kind)
                    if inst.op.startswith("send"):
                        queues[key].append((kind, inst.microbatch, peer, clock[rank] + costs.comm, inst))
                    elif not queues[key]:
                        break
                    else:
                        got_kind, mb, to_stage, arrival, sent = queues[key].popleft()
                        if (got_kind, mb, to_stage) != (kind, inst.microbatch, stage):
                            raise ScheduleError(
                                f"rank {dst} {_name(inst, virtual_pp)} received {_name(sent, virtual_pp)} "
                                f"from rank {src}: sends on rank {src} and receives on rank {dst} are in different "
                                f"orders, so an untagged (NCCL) transfer would deliver the wrong tensor")
                        clock[rank] = max(clock[rank], arrival)
                pc[rank] += 1
                progress = True
    if any(pc[r] < len(schedule[r]) for r in range(pp)):
        blocked = "; ".join(f"rank {r}: " + (f"waits at {_name(schedule[r][pc[r]], virtual_pp)} (instruction "
                                              f"{pc[r]})" if pc[r] < len(schedule[r]) else "finished")
                            for r in range(pp))
        raise ScheduleError(f"deadlock: {blocked}")
    # check_structure pairs every send with one receive on the peer, so all ranks finishing means all matched.
    return SimulationResult(pp=pp, virtual_pp=virtual_pp, num_microbatches=num_microbatches, spans=spans,
                            makespan=max(clock), max_in_flight=[_max_in_flight(p) for p in schedule])
