"""Discrete-event simulation of a pipeline schedule under NCCL's point-to-point rules, without processes.

The model is the strictest the hardware may apply:
- tags do not exist: the k-th send from rank a to rank b delivers to the k-th receive that
  b posts from a, whatever either side meant by it (a mismatch is an error);
- every send is a rendezvous: it completes only once its receive has been posted (NCCL
  buffers only small messages; a 32 MiB activation waits for the peer);
- a transfer group (one ``batch_isend_irecv``) is posted as a whole and its rank waits
  until every transfer in it has completed;
- a rank runs its program in order.
A schedule that finishes here finishes on NCCL (posting earlier or buffering only helps),
and the simulation gives every compute op's time, hence the bubble.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

from .program import BACKWARDS, Instruction, TransferGroup, computes_of, max_in_flight, run_programs, stage_rank
from .program import transfers_of, virtual_stage

Cost = Union[float, Sequence[float]]


class ScheduleError(ValueError):
    """A schedule that the executor could not run: malformed, mismatched transfers or deadlock."""


@dataclass(frozen=True)
class Costs:
    """Time of each op. ``forward``/``backward`` are one number or one per virtual stage (uneven partitions).

    ``backward`` is a whole backward (B); where a schedule splits it (ZB-H1), W takes ``weight`` (half of
    ``backward`` unless given) and I the rest."""

    forward: Cost = 1.0
    backward: Cost = 2.0
    comm: float = 0.0  # from the moment both sides of a transfer are posted until it completes
    weight: Cost | None = None

    def of(self, inst: Instruction, stage: int) -> float:
        if inst.op == "forward":
            return _at(self.forward, stage)
        if inst.op == "backward":
            return _at(self.backward, stage)
        weight = _at(self.weight, stage) if self.weight is not None else _at(self.backward, stage) / 2
        return weight if inst.op == "backward_weight" else _at(self.backward, stage) - weight


def _at(cost: Cost, stage: int) -> float:
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


def _name(step, virtual_pp: int) -> str:
    return step.label(virtual_pp > 1)


def _flatten(program: list) -> list[Instruction]:
    return [t for step in program for t in (step.transfers if isinstance(step, TransferGroup) else computes_of(step))]


def check_structure(schedule: list[list], num_microbatches: int, virtual_pp: int = 1,
                    forward_only: bool = False, v_shape: bool = False) -> None:
    """Each rank runs every (chunk, micro-batch)'s F exactly once and then either its B, or its I and then its W,
    exactly once, with transfers adjacent (``v_shape``: the V's stages, ``program.virtual_stage``)."""
    pp = len(schedule)
    expected_units = {(c, mb) for c in range(virtual_pp) for mb in range(num_microbatches)}
    for rank, program in enumerate(schedule):
        flat = _flatten(program)
        computes = [inst for inst in flat if inst.is_compute]
        for inst in computes:
            if not (0 <= inst.chunk < virtual_pp and 0 <= inst.microbatch < num_microbatches):
                raise ScheduleError(f"rank {rank}: {_name(inst, virtual_pp)} is outside chunk 0..{virtual_pp - 1} "
                                    f"or micro-batch 0..{num_microbatches - 1}")
        units_of = lambda ops: [(i.chunk, i.microbatch) for i in computes if i.op in ops]  # noqa: E731
        checks = [("F", units_of(("forward",)), expected_units)]
        if not forward_only:
            split = units_of(("backward_input",))
            checks += [("B or I", units_of(BACKWARDS), expected_units), ("W (after each I)",
                                                                         units_of(("backward_weight",)), set(split))]
        for what, units, expected in checks:
            if len(units) != len(set(units)) or set(units) != expected:
                missing = sorted(expected - set(units))
                repeated = sorted({u for u in units if units.count(u) > 1})
                raise ScheduleError(f"rank {rank}: every (chunk, micro-batch) must run {what} exactly once; "
                                    f"missing {missing}, repeated {repeated}")
        done = set()
        for inst in computes:
            unit = (inst.chunk, inst.microbatch)
            before = {"backward": "forward", "backward_input": "forward", "backward_weight": "backward_input"}.get(
                inst.op)
            if before and (before, unit) not in done:
                raise ScheduleError(f"rank {rank}: {_name(inst, virtual_pp)} runs before its {before}")
            done.add((inst.op, unit))
        _check_transfers(program, rank, pp, virtual_pp, v_shape)


def _check_transfers(program: list, rank: int, pp: int, virtual_pp: int, v_shape: bool) -> None:
    """Every transfer a compute needs exists once: each receive is in a group before the compute that
    consumes it, each send in a group after the compute that produces it."""
    stages, done, seen = pp * virtual_pp, set(), set()  # done: the computes run, an I counted as its B
    stage_of = lambda inst: virtual_stage(rank, inst.chunk, pp, v_shape)  # noqa: E731
    for index, step in enumerate(program):
        if step.is_compute:
            for inst in computes_of(step):
                recvs, sends = transfers_of(inst, stage_of(inst), stages, v_shape)
                missing = [r for r in recvs if r not in seen]
                if missing:
                    raise ScheduleError(f"rank {rank}, step {index}: {_name(inst, virtual_pp)} runs before its "
                                        f"receive {_name(missing[0], virtual_pp)}; each receive must be in a "
                                        f"transfer group before the compute that consumes it")
            done.update(Instruction("backward" if i.op in BACKWARDS else i.op, i.microbatch, i.chunk)
                        for i in computes_of(step))
            continue
        for transfer in step.transfers:
            compute = Instruction("forward" if transfer.op.endswith("forward") else "backward", transfer.microbatch,
                                  transfer.chunk)
            recvs, sends = transfers_of(compute, stage_of(compute), stages, v_shape)
            if transfer in seen or transfer not in recvs + sends:
                raise ScheduleError(f"rank {rank}, step {index}: {_name(transfer, virtual_pp)} is "
                                    f"{'repeated' if transfer in seen else 'not needed (first/last virtual stage)'}")
            if (transfer in recvs) == (compute in done):
                raise ScheduleError(f"rank {rank}, step {index}: {_name(transfer, virtual_pp)} comes "
                                    f"{'after' if compute in done else 'before'} {_name(compute, virtual_pp)}; a "
                                    f"receive must precede the compute that consumes it and a send follow the one "
                                    f"that produces it")
            seen.add(transfer)
    needed = {t for c in done for t in sum(transfers_of(c, stage_of(c), stages, v_shape), [])}
    if needed - seen:
        raise ScheduleError(f"rank {rank}: transfers missing: "
                            f"{' '.join(sorted(_name(t, virtual_pp) for t in needed - seen))}")


def _payload(inst: Instruction, rank: int, pp: int, v_shape: bool) -> tuple[int, int, int, int]:
    """(source rank, destination rank, what travels: ("activation"|"gradient", micro-batch, receiving stage))."""
    stage = virtual_stage(rank, inst.chunk, pp, v_shape)
    forward, sending = inst.op.endswith("forward"), inst.op.startswith("send")
    peer_stage = stage + 1 if forward == sending else stage - 1
    receiving_stage = peer_stage if sending else stage
    peer = stage_rank(peer_stage, pp, v_shape)
    src, dst = (rank, peer) if sending else (peer, rank)
    return src, dst, ("activation" if forward else "gradient", inst.microbatch, receiving_stage)


def _match_transfers(schedule: list[list], virtual_pp: int, v_shape: bool) -> dict:
    """(rank, step index, transfer) -> (peer rank, peer's step index), pairing by order per directed pair."""
    pp = len(schedule)
    sends, recvs = {}, {}
    for rank, program in enumerate(schedule):
        for index, step in enumerate(program):
            for inst in step.transfers if isinstance(step, TransferGroup) else ():
                src, dst, payload = _payload(inst, rank, pp, v_shape)
                side = sends if inst.op.startswith("send") else recvs
                side.setdefault((src, dst), []).append((rank, index, inst, payload))
    counterpart = {}
    for pair in sorted(set(sends) | set(recvs)):
        out, into = sends.get(pair, []), recvs.get(pair, [])
        for k, (sent, received) in enumerate(zip(out, into)):
            if sent[3] != received[3]:
                raise ScheduleError(
                    f"rank {pair[1]} {_name(received[2], virtual_pp)} would receive {_name(sent[2], virtual_pp)} "
                    f"from rank {pair[0]} (transfer {k} on that pair): sends on rank {pair[0]} and receives on rank "
                    f"{pair[1]} are in different orders, so NCCL (no tags) would deliver the wrong tensor")
            counterpart[(sent[0], sent[1], sent[2])] = (received[0], received[1])
            counterpart[(received[0], received[1], received[2])] = (sent[0], sent[1])
        if len(out) != len(into):
            raise ScheduleError(f"rank {pair[0]} sends {len(out)} tensors to rank {pair[1]}, which receives "
                                f"{len(into)}: the surplus would never complete")
    return counterpart


def simulate(schedule: list[list], num_microbatches: int, virtual_pp: int = 1, costs: Costs = Costs(),
             forward_only: bool = False, v_shape: bool = False) -> SimulationResult:
    """Run ``schedule`` under NCCL's rules and return per-rank op times; raise ScheduleError if it cannot finish.
    ``v_shape``: the V schedules' stage layout (``program.virtual_stage``). An Overlapped unit runs its halves
    back to back (no speed-up assumed from the overlap)."""
    if not schedule:
        raise ScheduleError("the schedule has no ranks; fix: pass one instruction list per pipeline rank")
    check_structure(schedule, num_microbatches, virtual_pp, forward_only, v_shape)
    counterpart = _match_transfers(schedule, virtual_pp, v_shape)
    pp = len(schedule)
    clock = [0.0] * pp
    posted_at: dict[tuple[int, int], float] = {}
    spans: list[list[Span]] = [[] for _ in range(pp)]

    def advance(rank: int, index: int, step) -> bool:
        if step.is_compute:
            for inst in computes_of(step):
                start = clock[rank]
                clock[rank] = start + costs.of(inst, virtual_stage(rank, inst.chunk, pp, v_shape))
                spans[rank].append(Span(inst, start, clock[rank]))
            return True
        posted_at.setdefault((rank, index), clock[rank])
        peers = [counterpart[(rank, index, t)] for t in step.transfers]
        if any(peer not in posted_at for peer in peers):
            return False  # a peer has not posted its side yet
        clock[rank] = max([clock[rank]] + [posted_at[p] for p in peers]) + costs.comm
        return True

    pc = run_programs(schedule, advance)
    if any(pc[r] < len(schedule[r]) for r in range(pp)):
        raise ScheduleError("deadlock under NCCL's rules: " + "; ".join(
            _blocked(schedule, counterpart, posted_at, pc, r, virtual_pp) for r in range(pp)))
    return SimulationResult(pp=pp, virtual_pp=virtual_pp, num_microbatches=num_microbatches, spans=spans,
                            makespan=max(clock), max_in_flight=[max_in_flight(p) for p in schedule])


def _blocked(schedule, counterpart, posted_at, pc, rank: int, virtual_pp: int) -> str:
    program = schedule[rank]
    if pc[rank] >= len(program):
        return f"rank {rank}: finished"
    step = program[pc[rank]]
    waits = [f"rank {peer[0]} to post its side of {_name(t, virtual_pp)}"
             for t in step.transfers for peer in [counterpart[(rank, pc[rank], t)]] if peer not in posted_at]
    return f"rank {rank}: waits at {_name(step, virtual_pp)} (step {pc[rank]}) for " + ", ".join(waits)
