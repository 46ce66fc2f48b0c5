"""Transfers placed by the ideal timeline: how the split-backward schedules (zb-h1, zb-v, dualpipev) post
their receives so that neither side of a transfer waits under NCCL's rendezvous rules.

A send goes out right after the compute that produced it. A receive is posted at the last point of the
receiver's program that comes, in the schedule's ideal timeline (the simulator's default costs, only data
dependencies, no transfer time), no later than the matching send. Posting it just before its consumer, as
1F1B does, would leave the sender blocked in its send whenever the receiver is busy with a W. Receives that
share a group are ordered by their send times, so each directed pair's transfers match in issue order.
The simulator proves the result and measures its bubble; nothing here guarantees it alone.
"""
from __future__ import annotations

from .program import BACKWARDS, Instruction, TransferGroup, computes_of, run_programs, transfers_of
from .program import virtual_stage

_COST = {"forward": 1, "backward": 2, "backward_input": 1, "backward_weight": 1}  # simulate.Costs() defaults


def _key(inst: Instruction, stage: int) -> tuple[str, int, int]:
    """What a compute makes: ("act"|"grad"|"weight", virtual stage, micro-batch)."""
    kind = "act" if inst.op == "forward" else "grad" if inst.op in BACKWARDS else "weight"
    return kind, stage, inst.microbatch


def _needs(inst: Instruction, stage: int, num_stages: int) -> tuple[str, int, int] | None:
    """What ``inst`` on ``stage`` waits for (``_key`` of its producer), None at the pipeline's start."""
    if inst.op == "forward":
        return ("act", stage - 1, inst.microbatch) if stage > 0 else None
    if inst.op in BACKWARDS:
        last = stage == num_stages - 1
        return ("act", stage, inst.microbatch) if last else ("grad", stage + 1, inst.microbatch)
    return "grad", stage, inst.microbatch


def ideal_ends(orders: list[list], virtual_pp: int, v_shape: bool = False) -> dict[tuple[str, int, int], int]:
    """End time of every compute (by ``_key``) when each starts as soon as its rank is free and its inputs
    exist; an Overlapped unit starts when both halves' inputs exist and makes both results at its end."""
    pp = len(orders)
    stages, ends, clock = pp * virtual_pp, {}, [0] * pp

    def advance(rank: int, _, step) -> bool:
        halves = computes_of(step)
        places = [virtual_stage(rank, i.chunk, pp, v_shape) for i in halves]
        needs = [n for i, s in zip(halves, places) if (n := _needs(i, s, stages)) is not None]
        if any(n not in ends for n in needs):
            return False
        clock[rank] = max([clock[rank]] + [ends[n] for n in needs]) + sum(_COST[i.op] for i in halves)
        ends.update({_key(i, s): clock[rank] for i, s in zip(halves, places)})
        return True

    run_programs(orders, advance)
    missing = [r for r, order in enumerate(orders) if any(_key(i, virtual_stage(r, i.chunk, pp, v_shape)) not in ends
                                                         for step in order for i in computes_of(step))]
    if missing:
        raise ValueError(f"the compute orders of ranks {missing} wait on each other (a data-dependency cycle); "
                         f"fix: order each rank's computes so that every input is made before it is needed")
    return ends


def place_transfers(orders: list[list], virtual_pp: int, v_shape: bool = False) -> list[list]:
    """Every rank's program: its computes (Instructions or Overlapped units), with transfer groups placed as
    the module docstring says."""
    pp, stages = len(orders), len(orders) * virtual_pp
    ends = ideal_ends(orders, virtual_pp, v_shape)
    programs = []
    for rank, order in enumerate(orders):
        # groups[j] is posted before compute j (groups[len(order)] at the end); boundary j: compute j-1's end
        sends: list[list[Instruction]] = [[] for _ in range(len(order) + 1)]
        recvs: list[list[tuple]] = [[] for _ in range(len(order) + 1)]
        boundary = [0]
        for j, step in enumerate(order):
            for half, inst in enumerate(computes_of(step)):
                stage = virtual_stage(rank, inst.chunk, pp, v_shape)
                needed, produced = transfers_of(inst, stage, stages, v_shape)
                sends[j + 1] += produced
                for recv in needed:
                    sent_at = ends[_needs(inst, stage, stages)]
                    k = j
                    while k > 0 and boundary[k] > sent_at:
                        k -= 1
                    producer_half = 0 if recv.op == "recv_forward" else 1  # an Overlapped sends F's output first
                    recvs[k].append(((sent_at, producer_half), recv))
            boundary.append(max(ends[_key(i, virtual_stage(rank, i.chunk, pp, v_shape))] for i in computes_of(step)))
        program = []
        for j in range(len(order) + 1):
            group = sends[j] + [recv for _, recv in sorted(recvs[j], key=lambda item: item[0])]
            if group:
                program.append(TransferGroup(tuple(group)))
            program += order[j:j + 1]
        programs.append(program)
    return programs

