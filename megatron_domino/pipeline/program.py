"""A pipeline rank's program: the vocabulary every schedule is written in, and the stepper that walks programs.

A program is a list of steps: compute ``Instruction``s and ``TransferGroup``s between them. The computes use
torch.distributed.pipelining's letters:
    F  forward of a (chunk, micro-batch);
    B  its whole backward (input and weight gradients);
    I  the input-gradient half of a backward split in two (what the previous stage waits for);
    W  the weight-gradient half, which nobody waits for (zero-bubble schedules hold it back).
A micro-batch's activations live from its F to its B, or to its W when the backward is split. Transfers are
rF/sF (activations) and rB/sB (gradients, sent after a B or an I). Builders (``schedules``, ``zero_bubble``)
write programs in this vocabulary, the simulator proves them, the executor runs them; all of them import it
from here and nothing here imports them.

Layout: rank ``r`` holds ``virtual_pp`` model chunks; chunk ``c`` is global virtual stage ``c * pp + r``
(Megatron's interleaved layout), or, for the V schedules (zb-v, dualpipev: ``v_shape``), chunk 0 is stage ``r``
and chunk 1 stage ``2 pp - 1 - r``, so rank 0 holds the first and the last stage and the turn (stage pp - 1 to
pp) stays on rank pp - 1: a local handoff, no transfer. Activations of virtual stage ``s`` go to stage
``s + 1``; gradients flow back. ``Overlapped`` pairs a forward and a backward run as one unit (DualPipeV's F&B).
"""
from __future__ import annotations

from dataclasses import dataclass

OPS = ("recv_forward", "forward", "send_forward", "recv_backward", "backward", "backward_input", "send_backward",
       "backward_weight")
COMPUTE_OPS = ("forward", "backward", "backward_input", "backward_weight")
BACKWARDS = ("backward", "backward_input")  # the computes that produce the gradient sent to the previous stage
_PREFIX = {
    "recv_forward": "rF",
    "forward": "F",
    "send_forward": "sF",
    "recv_backward": "rB",
    "backward": "B",
    "backward_input": "I",
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


def virtual_stage(pp_rank: int, chunk: int, pp: int, v_shape: bool = False) -> int:
    """Global virtual stage of ``chunk`` on ``pp_rank``: the interleaved layout, or the V (2 chunks)."""
    if v_shape:
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    return chunk * pp + pp_rank


def stage_rank(stage: int, pp: int, v_shape: bool = False) -> int:
    """Pipeline rank holding virtual ``stage`` (the inverse of ``virtual_stage``, chunk aside)."""
    if v_shape:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


@dataclass(frozen=True)
class Overlapped:
    """A forward and a backward of two micro-batches run as one compute unit (DualPipe's "F&B"): each one's
    communication (its pipeline transfers, Domino's TP all-reduces, MoE all-to-alls) can hide behind the other's
    compute. The halves stay ordinary instructions, so transfers, structure checks and per-micro-batch state
    are those of two computes; the receives of both come before the unit, the sends of both after it. An
    executor may run the halves in sequence (no overlap) and stay correct."""

    forward: Instruction
    backward: Instruction

    op = "forward_backward"
    is_compute = True

    def __post_init__(self):
        if self.forward.op != "forward" or self.backward.op not in BACKWARDS:
            raise ValueError(f"Overlapped pairs a forward with a backward, got {self.forward.op!r} and "
                             f"{self.backward.op!r}; fix: Overlapped(Instruction('forward', ...), "
                             f"Instruction('backward', ...))")

    @property
    def halves(self) -> tuple[Instruction, Instruction]:
        return self.forward, self.backward

    def label(self, show_chunk: bool) -> str:
        """"F5.0&B1.1": both halves."""
        return f"{self.forward.label(show_chunk)}&{self.backward.label(show_chunk)}"

    def __str__(self) -> str:
        return self.label(bool(self.forward.chunk or self.backward.chunk))


def computes_of(step) -> tuple[Instruction, ...]:
    """The compute instructions of a program step: itself, an Overlapped's two halves, none for transfers."""
    if isinstance(step, Overlapped):
        return step.halves
    return (step,) if step.is_compute else ()


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


def transfers_of(compute: Instruction, stage: int, num_stages: int,
                 v_shape: bool = False) -> tuple[list[Instruction], list[Instruction]]:
    """(receives it needs, sends it feeds) of a compute instruction on virtual ``stage``; in the V the turn
    (stage num_stages / 2 - 1 to the next) is a local handoff."""
    mb, chunk = compute.microbatch, compute.chunk
    turn = num_stages // 2 - 1 if v_shape else -1  # the V's stage whose successor sits on the same rank
    if compute.op == "backward_weight":  # weight gradients stay on the rank
        return [], []
    if compute.op == "forward":
        needs_recv, needs_send = 0 < stage != turn + 1, num_stages - 1 > stage != turn
        recv, send = "recv_forward", "send_forward"
    elif compute.op in BACKWARDS:
        needs_recv, needs_send = num_stages - 1 > stage != turn, 0 < stage != turn + 1
        recv, send = "recv_backward", "send_backward"
    else:
        raise ValueError(f"transfers_of needs a compute instruction, got {compute.op!r}")
    recvs = [Instruction(recv, mb, chunk)] if needs_recv else []
    return recvs, ([Instruction(send, mb, chunk)] if needs_send else [])


def add_transfers(iterations: list[list[Instruction]], rank: int, pp: int, virtual_pp: int,
                  v_shape: bool = False) -> list:
    """A rank's program from its computes, grouped in iterations: after each iteration one transfer group
    holds the iteration's sends and the receives the next iteration needs (and the first iteration's
    receives come first). One compute per iteration is 1F1B's pairing; interleaving puts a forward and
    a backward in each steady-state iteration, so receives are posted one iteration ahead (Megatron's)."""
    stages = pp * virtual_pp
    program, pending_sends = [], []
    for iteration in iterations:
        recvs, sends = [], []
        for compute in iteration:
            needed, produced = transfers_of(compute, virtual_stage(rank, compute.chunk, pp, v_shape), stages, v_shape)
            recvs += needed
            sends += produced
        if pending_sends or recvs:
            program.append(TransferGroup(tuple(pending_sends + recvs)))
        program += iteration
        pending_sends = sends
    if pending_sends:
        program.append(TransferGroup(tuple(pending_sends)))
    return program


def max_in_flight(program: list) -> int:
    """Most micro-batches holding activations at once: from the F to the B, or to the W of a split backward."""
    alive, peak = 0, 0
    for step in program:
        for inst in computes_of(step):
            alive += 1 if inst.op == "forward" else -1 if inst.op in ("backward", "backward_weight") else 0
            peak = max(peak, alive)
    return peak


def run_programs(programs: list[list], advance) -> list[int]:
    """Step every rank through its program in order, in rounds until none can move: ``advance(rank, index,
    step)`` does a step and returns True, or False while it waits for another rank. Returns how far each got."""
    position = [0] * len(programs)
    progress = True
    while progress:
        progress = False
        for rank, program in enumerate(programs):
            while position[rank] < len(program) and advance(rank, position[rank], program[position[rank]]):
                position[rank] += 1
                progress = True
    return position
