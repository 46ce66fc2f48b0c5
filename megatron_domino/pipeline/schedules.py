"""Pipeline schedules as data: one list of steps per pipeline rank.

Keeping the schedule a plain value (instead of code interleaved with p2p calls)
lets the simulator prove it deadlock-free under NCCL's rules without starting a
process, and lets the executor stay a dumb loop over the list.

Layout: rank ``r`` holds ``virtual_pp`` model chunks; chunk ``c`` is global
virtual stage ``c * pp + r`` (Megatron's interleaved layout). Activations of
virtual stage ``s`` go to stage ``s + 1``; gradients flow back.

A rank's program alternates compute instructions with ``TransferGroup``s. The group
between two computes holds the send of what the first produced and the receive of what
the second consumes, issued together as one ``batch_isend_irecv`` (Megatron's
send-forward/receive-backward pairing). NCCL ignores tags, matches each pair's transfers
in issue order and completes a large send only once its receive runs; grouping the
send with the receive is what keeps neighbours from each waiting on the other's send.
Every rank visits forwards (and, separately, backwards) in the same rank-independent
``(chunk, microbatch)`` order, which keeps each pair's sends and receives in one order.
"""
from __future__ import annotations

from dataclasses import dataclass

OPS = ("recv_forward", "forward", "send_forward", "recv_backward", "backward", "send_backward", "backward_weight")
COMPUTE_OPS = ("forward", "backward", "backward_weight")
KINDS = ("none", "1f1b", "interleaved", "zb-h1")
_PREFIX = {
    "recv_forward": "rF",
    "forward": "F",
    "send_forward": "sF",
    "recv_backward": "rB",
    "backward": "B",
    "send_backward": "sB",
    "backward_weight": "W",
}


@dataclass(frozen=True)
class Instruction:
    """One step of a rank's schedule: compute or a point-to-point transfer of one micro-batch's tensor."""

    op: str  # one of OPS
    microbatch: int
    chunk: int = 0  # model chunk on this rank; global virtual stage chunk * pp + rank

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"Instruction op {self.op!r} is not a pipeline op; fix: use one of {', '.join(OPS)}")

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    def label(self, show_chunk: bool) -> str:
        """Short name such as "F3", "sB3" or, with the chunk shown, "F3.1"."""
        text = f"{_PREFIX[self.op]}{self.microbatch}"
        return f"{text}.{self.chunk}" if show_chunk else text

    def __str__(self) -> str:
        # The instruction does not know virtual_pp; chunk 0 is left implicit.
        # Callers that know virtual_pp > 1 use label(True) for uniform names.
        return self.label(self.chunk != 0)


def virtual_stage(pp_rank: int, chunk: int, pp: int) -> int:
    """Global virtual stage of ``chunk`` on ``pp_rank`` in the interleaved layout."""
    return chunk * pp + pp_rank


@dataclass(frozen=True)
class TransferGroup:
    """Transfers issued together (one ``batch_isend_irecv``); the group completes when all of them have."""

    transfers: tuple[Instruction, ...]

    op = "transfers"
    is_compute = False

    def label(self, show_chunk: bool) -> str:
        """"[sF3 rB1]": the grouped transfers, as ``--ops`` prints them."""
        return "[" + " ".join(t.label(show_chunk) for t in self.transfers) + "]"

    def __str__(self) -> str:
        return self.label(any(t.chunk for t in self.transfers))


def transfers_of(compute: Instruction, stage: int, num_stages: int) -> tuple[list[Instruction], list[Instruction]]:
    """(receives it needs, sends it feeds) of a compute instruction on virtual ``stage``."""
    mb, chunk = compute.microbatch, compute.chunk
    if compute.op == "backward_weight":  # weight gradients stay on the rank
        return [], []
    if compute.op == "forward":
        needs_recv, needs_send = stage > 0, stage < num_stages - 1
        recv, send = "recv_forward", "send_forward"
    elif compute.op == "backward":
        needs_recv, needs_send = stage < num_stages - 1, stage > 0
        recv, send = "recv_backward", "send_backward"
    else:
        raise ValueError(f"transfers_of needs a compute instruction, got {compute.op!r}")
    recvs = [Instruction(recv, mb, chunk)] if needs_recv else []
    return recvs, ([Instruction(send, mb, chunk)] if needs_send else [])


def add_transfers(iterations: list[list[Instruction]], rank: int, pp: int, virtual_pp: int) -> list:
    """A rank's program from its computes, grouped in iterations: after each iteration one transfer group
    holds the iteration's sends and the receives the next iteration needs (and the first iteration's
    receives come first). One compute per iteration is 1F1B's pairing; interleaving puts a forward and
    a backward in each steady-state iteration, so receives are posted one iteration ahead (Megatron's)."""
    stages = pp * virtual_pp
    program, pending_sends = [], []
    for iteration in iterations:
        recvs, sends = [], []
        for compute in iteration:
            needed, produced = transfers_of(compute, virtual_stage(rank, compute.chunk, pp), stages)
            recvs += needed
            sends += produced
        if pending_sends or recvs:
            program.append(TransferGroup(tuple(pending_sends + recvs)))
        program += iteration
        pending_sends = sends
    if pending_sends:
        program.append(TransferGroup(tuple(pending_sends)))
    return program


def _one_forward_one_backward(forwards: list, backwards: list, warmup: int) -> list[list[Instruction]]:
    """Warm-up forwards, then iterations of one forward and one backward, then drain the backwards."""
    steady = len(forwards) - warmup
    iterations = [[f] for f in forwards[:warmup]]
    iterations += [[forwards[warmup + i], backwards[i]] for i in range(steady)]
    return iterations + [[b] for b in backwards[steady:]]


def _interleaved_chunk(k: int, pp: int, virtual_pp: int, forward: bool) -> int:
    """Chunk of the k-th virtual micro-batch: groups of pp micro-batches sweep the chunks in turn."""
    chunk = (k % (pp * virtual_pp)) // pp
    return chunk if forward else virtual_pp - 1 - chunk


def _interleaved_microbatch(k: int, pp: int, virtual_pp: int) -> int:
    return (k // (pp * virtual_pp)) * pp + k % pp


def _interleaved_order(pp: int, rank: int, m: int, v: int) -> list[list[Instruction]]:
    total = m * v
    fwd = [Instruction("forward", _interleaved_microbatch(k, pp, v), _interleaved_chunk(k, pp, v, True))
           for k in range(total)]
    bwd = [Instruction("backward", _interleaved_microbatch(k, pp, v), _interleaved_chunk(k, pp, v, False))
           for k in range(total)]
    return _one_forward_one_backward(fwd, bwd, interleaved_warmup(pp, rank, m, v))


def interleaved_warmup(pp: int, rank: int, num_microbatches: int, virtual_pp: int) -> int:
    """Chunk-forwards a rank runs before its first backward in the interleaved schedule (Megatron's rule).

    Enough for micro-batch 0 to reach the last virtual stage and its gradient to come back to this rank;
    with exactly pp micro-batches every forward runs first.
    """
    total = num_microbatches * virtual_pp
    if num_microbatches == pp:
        return total
    return min((pp - rank - 1) * 2 + (virtual_pp - 1) * pp, total)


def schedule_kind(pp: int, virtual_pp: int, requested: str | None = None) -> str:
    """The schedule a layout runs: ``requested`` (parallel.pipeline_schedule) where set, else "interleaved" with
    several chunks per rank and "1f1b" with one; "none" without a pipeline, whatever was requested."""
    if pp == 1:
        return "none"
    if requested is not None:
        return requested
    return "interleaved" if virtual_pp > 1 else "1f1b"


def _validate(kind: str, pp: int, m: int, v: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"pipeline schedule kind {kind!r} is not one of {', '.join(KINDS)}; "
                         f"fix: use 'none' for parallel.pp = 1, '1f1b', 'zb-h1', or 'interleaved' with "
                         f"parallel.virtual_pp > 1")
    if pp < 1 or v < 1:
        raise ValueError(f"parallel.pp = {pp} and parallel.virtual_pp = {v} must both be >= 1; "
                         f"fix: set them to 1 or more")
    if m < 1:
        raise ValueError(f"the number of micro-batches (train.global_batch_size / (train.micro_batch_size * dp)) "
                         f"is {m} but must be >= 1; fix: raise train.global_batch_size")
    if kind == "none" and (pp != 1 or v != 1):
        raise ValueError(f"schedule 'none' runs without a pipeline but parallel.pp = {pp}, parallel.virtual_pp = {v}; "
                         f"fix: set parallel.pp: 1 and parallel.virtual_pp: 1, or use the '1f1b' schedule")
    if kind in ("1f1b", "zb-h1") and v != 1:
        raise ValueError(f"schedule {kind!r} holds one model chunk per rank but parallel.virtual_pp = {v}; "
                         f"fix: set parallel.virtual_pp: 1, or use the 'interleaved' schedule")
    if kind == "interleaved":
        if pp < 2 or v < 2:
            raise ValueError(f"the interleaved schedule needs parallel.pp > 1 and parallel.virtual_pp > 1, "
                             f"got parallel.pp = {pp}, parallel.virtual_pp = {v}; "
                             f"fix: raise them, or use '1f1b' (parallel.virtual_pp: 1) or 'none' (parallel.pp: 1)")
        if m % pp:
            raise ValueError(f"the interleaved schedule needs the number of micro-batches "
                             f"(train.global_batch_size / (train.micro_batch_size * dp) = {m}) to be a multiple of "
                             f"parallel.pp = {pp} (parallel.virtual_pp = {v}); fix: make train.global_batch_size a "
                             f"multiple of train.micro_batch_size * dp * {pp}, or set parallel.virtual_pp: 1")


def schedule_for(parallel, num_microbatches: int, forward_only: bool = False) -> tuple[str, list[list]]:
    """What a run with these settings (``cfg.parallel``) executes: the schedule's kind and every rank's
    program. Training, evaluation and ``--print-schedule`` all come through here."""
    kind = schedule_kind(parallel.pp, parallel.virtual_pp, parallel.pipeline_schedule)
    return kind, build_schedule(kind, parallel.pp, num_microbatches, parallel.virtual_pp, forward_only)


def build_schedule(kind: str, pp: int, num_microbatches: int, virtual_pp: int = 1,
                   forward_only: bool = False) -> list[list]:
    """Program (compute instructions and transfer groups) of every pipeline rank (index = rank).

    "none": pp = 1, F0 B0 F1 B1 ... (gradient accumulation, one micro-batch alive).
    "1f1b": warm-up of min(pp - rank - 1, m) forwards, steady one-forward-one-backward, cool-down.
    "interleaved": the same shape over m * virtual_pp chunk-micro-batches (Megatron's interleaved 1F1B).
    "zb-h1": 1F1B with each backward split into B and a held-back W (``zero_bubble``).
    ``forward_only`` (evaluation): the schedule's forwards in the same order, no backwards.
    """
    _validate(kind, pp, num_microbatches, virtual_pp)
    m = num_microbatches
    if kind == "zb-h1" and not forward_only:
        from .zero_bubble import zb_h1_programs  # built on this module's instructions
        return zb_h1_programs(pp, m)
    schedule = []
    for rank in range(pp):
        if kind == "interleaved":
            iterations = _interleaved_order(pp, rank, m, virtual_pp)
        else:  # 1F1B's order; ZB-H1's forwards run in the same order
            fwd = [Instruction("forward", i) for i in range(m)]
            bwd = [Instruction("backward", i) for i in range(m)]
            # 1F1B sends each output right after computing it: one compute per iteration.
            iterations = [[c] for it in _one_forward_one_backward(fwd, bwd, min(pp - rank - 1, m)) for c in it]
        if forward_only:
            iterations = [[c for c in it if c.op == "forward"] for it in iterations]
            iterations = [it for it in iterations if it]
        schedule.append(add_transfers(iterations, rank, pp, virtual_pp))
    return schedule
