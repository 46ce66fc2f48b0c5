"""List scheduling on the V: the clock the V schedules (zb-v, dualpipev) are derived on.

Rank r holds chunk 0 (stage r) and chunk 1 (stage 2 pp - 1 - r). The clock runs with the simulator's default
costs (F 1, B 2, I 1, W 1, per chunk) and only data dependencies: whenever a rank is free it asks its
schedule's ``choose`` which of its ready computes runs next (or none), as the zero-bubble papers' heuristic
builders do. The compute order each rank ends up with is the schedule; ``placement`` then adds the transfers
and the simulator proves it under NCCL's rules. Deriving the order on a clock, rather than writing its phases
by hand, keeps it right for every pp and micro-batch count, including the few-micro-batch cases.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .program import Instruction, Overlapped, computes_of

COST = {"forward": 1, "backward": 2, "backward_input": 1, "backward_weight": 1}


@dataclass
class RankState:
    """What one rank has run: per chunk its forwards, its backwards (B or I), the micro-batches whose backward
    was split (their W's follow in that order) and their W's; activations alive, and its order."""

    forwards: list = field(default_factory=lambda: [0, 0])
    backwards: list = field(default_factory=lambda: [0, 0])
    split: list = field(default_factory=lambda: [[], []])
    weights: list = field(default_factory=lambda: [0, 0])
    alive: int = 0  # chunk-micro-batches from F to their B or W
    order: list = field(default_factory=list)

    def next_microbatch(self, op: str, chunk: int) -> int | None:
        """The micro-batch (op, chunk) would run next, None when a W has no I waiting."""
        if op == "forward":
            return self.forwards[chunk]
        if op == "backward_weight":
            k = self.weights[chunk]
            return self.split[chunk][k] if k < len(self.split[chunk]) else None
        return self.backwards[chunk]

    def record(self, inst: Instruction) -> None:
        c = inst.chunk
        if inst.op == "forward":
            self.forwards[c] += 1
            self.alive += 1
        elif inst.op == "backward_weight":
            self.weights[c] += 1
            self.alive -= 1
        else:
            self.backwards[c] += 1
            if inst.op == "backward_input":
                self.split[c].append(inst.microbatch)
            else:
                self.alive -= 1

    def finished(self, m: int) -> bool:
        """Every chunk's m forwards and m backwards ran, and a W after each I."""
        return all(self.forwards[c] == m == self.backwards[c] and self.weights[c] == len(self.split[c])
                   for c in (0, 1))


def _made_by(inst: Instruction, rank: int, pp: int) -> tuple | None:
    """(kind, rank, chunk, micro-batch) that ``inst`` on ``rank`` waits for, along the V."""
    k, c = inst.microbatch, inst.chunk
    if inst.op == "forward":
        if c == 0:
            return None if rank == 0 else ("act", rank - 1, 0, k)
        return ("act", rank, 0, k) if rank == pp - 1 else ("act", rank + 1, 1, k)
    if inst.op == "backward_weight":
        return "grad", rank, c, k
    if c == 1:
        return ("act", rank, 1, k) if rank == 0 else ("grad", rank - 1, 1, k)
    return ("grad", rank, 1, k) if rank == pp - 1 else ("grad", rank + 1, 0, k)


def _makes(inst: Instruction, rank: int) -> tuple:
    kind = "act" if inst.op == "forward" else "grad" if inst.op != "backward_weight" else "weight"
    return kind, rank, inst.chunk, inst.microbatch


def v_orders(pp: int, num_microbatches: int, choose) -> list[list]:
    """Every rank's compute order. ``choose(rank, state, ready)`` gets ``ready(op, chunk) -> Instruction |
    None`` (the next micro-batch of (op, chunk) if its input exists now; a W once its I ran) and returns an
    Instruction, an Overlapped pair, or None to wait."""
    m = num_microbatches
    states = [RankState() for _ in range(pp)]
    made: dict[tuple, int] = {}
    free, now = [0] * pp, 0
    while not all(state.finished(m) for state in states):
        for rank, state in enumerate(states):
            if free[rank] > now:
                continue

            def ready(op: str, chunk: int, rank=rank, state=state) -> Instruction | None:
                k = state.next_microbatch(op, chunk)
                if k is None or k >= m:
                    return None
                inst = Instruction(op, k, chunk)
                needs = _made_by(inst, rank, pp)
                return inst if needs is None or made.get(needs, now + 1) <= now else None

            step = choose(rank, state, ready)
            if step is None:
                continue
            halves = computes_of(step)
            free[rank] = now + sum(COST[i.op] for i in halves)
            for inst in halves:
                made[_makes(inst, rank)] = free[rank]
                state.record(inst)
            state.order.append(step)
        now += 1
        if now > 10 * pp * m + 100:
            raise ValueError(f"the V schedule stalls at pp = {pp}, {m} micro-batches: its rule waits for a compute "
                             f"that never becomes ready; fix: use m >= pp micro-batches")
    return [state.order for state in states]


def pair(forward: Instruction | None, backward: Instruction | None):
    """An Overlapped unit of both when both exist, else whichever does."""
    if forward is not None and backward is not None:
        return Overlapped(forward, backward)
    return forward or backward
