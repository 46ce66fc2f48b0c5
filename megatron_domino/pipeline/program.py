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
(Megatron's interleaved layout). Activations of virtual stage ``s`` go to stage ``s + 1``; gradients flow back.
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
    elif compute.op in BACKWARDS:
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


def max_in_flight(program: list) -> int:
    """Most micro-batches holding activations at once: from the F to the B, or to the W of a split backward."""
    alive, peak = 0, 0
    for step in program:
        if step.is_compute:
            alive += 1 if step.op == "forward" else -1 if step.op in ("backward", "backward_weight") else 0
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
