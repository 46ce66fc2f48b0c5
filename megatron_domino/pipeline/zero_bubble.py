"""The ZB-H1 schedule (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with the backward split in two.

I ("backward_input") computes the input gradient, which the previous stage waits for; W ("backward_weight")
computes the weight gradients, which nobody waits for. Sending I's result before doing W lets a gradient
cross the pipeline in the time of I alone, and held-back W's fill the cool-down where 1F1B idles.

Transfers: a send goes out right after the compute that produced it, as in 1F1B. A receive is posted at
the last point of the receiver's program that comes, in the schedule's ideal timeline (F = B = W, only
data dependencies), no later than the matching send: the two sides of every transfer then meet without
either rank waiting, under NCCL's rendezvous rules (the simulator proves it and measures the bubble).
Posting a receive just before its consumer, as 1F1B does, would leave the sender blocked in its send
whenever the receiver is busy with a W.
"""
from __future__ import annotations

from collections import deque

from .program import Instruction, TransferGroup, run_programs, transfers_of

_UNIT = {"forward": 1, "backward_input": 1, "backward_weight": 1}


def zb_h1_order(pp: int, rank: int, num_microbatches: int) -> list[Instruction]:
    """Rank ``rank``'s computes: 1F1B's forwards and I's (warm-up of pp - rank - 1 forwards), W's kept
    ``rank`` behind the I's, then drained. A micro-batch holds its activations from F to W, so rank r holds
    at most (pp - r - 1) + 1 + r = pp of them: 1F1B's peak (rank 0's), as the paper's H1 requires. With
    uniform costs and m >= pp each rank idles (pp - 1)(F + I - W) of a makespan m(F + I + W) + (pp - 1)(F + I - W).
    """
    m = num_microbatches
    warmup = min(pp - rank - 1, m)
    order = [Instruction("forward", i) for i in range(warmup)]
    held: deque[int] = deque()
    for k in range(m):
        if warmup + k < m:
            order.append(Instruction("forward", warmup + k))
        order.append(Instruction("backward_input", k))
        held.append(k)
        if len(held) > rank:
            order.append(Instruction("backward_weight", held.popleft()))
    return order + [Instruction("backward_weight", k) for k in held]


def _producer(inst: Instruction, rank: int, pp: int) -> tuple[int, str, int] | None:
    """(rank, op, micro-batch) of the compute whose result ``inst`` needs before it can start."""
    if inst.op == "forward":
        return (rank - 1, "forward", inst.microbatch) if rank > 0 else None
    if inst.op == "backward_input":
        return (rank + 1, "backward_input", inst.microbatch) if rank < pp - 1 else (rank, "forward", inst.microbatch)
    return rank, "backward_input", inst.microbatch


def _ideal_ends(orders: list[list[Instruction]], pp: int) -> dict[tuple[int, str, int], int]:
    """End time of every compute with unit costs, each starting once its rank and its input are free."""
    ends, clock = {}, [0] * pp

    def advance(rank: int, _, inst: Instruction) -> bool:
        needs = _producer(inst, rank, pp)
        if needs is not None and needs not in ends:
            return False
        clock[rank] = max(clock[rank], ends.get(needs, 0)) + _UNIT[inst.op]
        ends[(rank, inst.op, inst.microbatch)] = clock[rank]
        return True

    run_programs(orders, advance)
    return ends


def zb_h1_programs(pp: int, num_microbatches: int) -> list[list]:
    """Every rank's program: its ZB-H1 computes with the transfer groups placed as the docstring says."""
    orders = [zb_h1_order(pp, rank, num_microbatches) for rank in range(pp)]
    ends = _ideal_ends(orders, pp)
    programs = []
    for rank, order in enumerate(orders):
        # groups[j] is posted before compute j (groups[len(order)] at the end); boundary j's time is compute j-1's end
        groups: list[list[Instruction]] = [[] for _ in range(len(order) + 1)]
        boundary = [0] + [ends[(rank, inst.op, inst.microbatch)] for inst in order]
        for j, inst in enumerate(order):
            recvs, sends = transfers_of(inst, rank, pp)
            groups[j + 1] = sends + groups[j + 1]
            for recv in recvs:
                sent_at = ends[_producer(inst, rank, pp)]
                k = j
                while k > 0 and boundary[k] > sent_at:
                    k -= 1
                groups[k].append(recv)
        program = []
        for j, group in enumerate(groups):
            if group:
                program.append(TransferGroup(tuple(group)))
            program += order[j:j + 1]
        programs.append(program)
    return programs
