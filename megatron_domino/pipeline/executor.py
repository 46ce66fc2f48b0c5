"""Runs one rank's program: forward/backward of model chunks and the transfer groups between them.

The executor holds no scheduling logic: the order and the grouping of transfers come from
``schedules.build_schedule``. It keeps at most the activations the schedule has in flight,
releases each sent output's data (only its autograd graph stays; in a forward-only run the
output is dropped), and tells the gradient synchroniser which backward is the last of the step
so DP reductions overlap the cool-down. A B runs the whole backward; an I computes the input
gradient only and its W the weight gradients (``split_backward``), so the weight gradients, and the
gradient synchroniser's hook, come with the W. A failure names the step and the peers it waits for.

The V schedules (zb-v, dualpipev: ``StageContext.v_shape``) place chunk 1 on the way back up, so its transfers
go to the previous rank and its gradients to the next; at the turn (rank pp - 1, chunk 0 to chunk 1) the
activation and its gradient are handed over locally. An ``Overlapped`` F&B unit runs its halves in turns at
their communication waits (``parallel.turns``) when ``overlap_units`` is set, else one after the other.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch.profiler import record_function

from ..parallel.turns import Turns
from .p2p import ACTIVATION, GRADIENT, P2P, Arrival, Transfer
from .program import BACKWARDS, Instruction, Overlapped, TransferGroup, computes_of, stage_rank, virtual_stage
from .split_backward import backward_input, backward_weight, run_backward


@dataclass
class StageContext:
    """What the executor needs to know about this rank's place in the pipeline."""

    pp_rank: int
    pp: int
    virtual_pp: int
    next_rank: int  # global rank of the next pipeline stage (wrapping)
    prev_rank: int
    activation_shape: tuple  # [micro batch, seq (/ tp under SP), hidden]
    dtype: torch.dtype
    v_shape: bool = False  # the V schedules' layout (``program.virtual_stage``)


def _release(output: torch.Tensor) -> None:
    """Free an activation's storage but keep its autograd graph (backward gets the gradient explicitly)."""
    output.data = torch.empty((1,), dtype=output.dtype, device=output.device)


class PipelineExecutor:
    def __init__(self, chunks: list, stage: StageContext, p2p: P2P, *,
                 loss_fn: Callable, on_backward: Callable[[bool], None] | None = None,
                 overlap_units: torch.device | None = None, turn_taking=None):
        """``loss_fn(output, batch) -> (tensor to backpropagate, detached value)`` on the last stage;
        ``on_backward(is_last)`` is called before every backward, B, I and W, all of which may produce weight
        gradients (B under Domino: ``split_backward``), with whether it is the last of its kind (the DP
        gradient sync's hook). ``overlap_units``: the device on which F&B units run their halves in turns
        (None: in sequence), at the waits the run's ``turn_taking`` (``parallel.turns.TurnTaking``) hears of;
        ``handovers`` counts the turns taken."""
        self.chunks, self.stage, self.p2p = chunks, stage, p2p
        self.loss_fn, self.on_backward = loss_fn, on_backward
        self.overlap_units, self.turn_taking, self.handovers = overlap_units, turn_taking, 0
        self.num_stages = stage.pp * stage.virtual_pp
        self.current: Instruction | TransferGroup | None = None
        self.waiting: Arrival | None = None  # the receive being waited for, for hang reports
        self.position, self.length = 0, 0
        self.step_timer: Callable | None = None  # step -> context manager around it (the timed rehearsal's)

    def _stage_of(self, chunk: int) -> int:
        return virtual_stage(self.stage.pp_rank, chunk, self.stage.pp, self.stage.v_shape)

    def _at_turn(self, chunk: int) -> bool:
        """Whether ``chunk`` is the V's turn: chunk 0 on the last rank, whose successor (chunk 1) is local."""
        return self.stage.v_shape and chunk == 0 and self.stage.pp_rank == self.stage.pp - 1

    def run(self, schedule: list, microbatches: list[dict]) -> list[torch.Tensor]:
        """Execute ``schedule``; returns the detached values ``loss_fn`` gave for the micro-batches whose loss
        lives here."""
        self._inputs, self._outputs, self._grads_in, self._grads_out, losses = {}, {}, {}, {}, []
        self._weights = {}  # (chunk, micro-batch) -> what its W needs
        computes = [inst for step in schedule for inst in computes_of(step)]
        self._forward_only = not any(inst.op in BACKWARDS for inst in computes)
        # chunk -> the micro-batch of its last B or I: that backward and its W end the chunk's gradients (the DP
        # reduction's cue); dualpipev runs some of a chunk's backwards whole and others split, so it is the last
        # in program order, whatever the kind
        self._last_backward = {inst.chunk: inst.microbatch for inst in computes if inst.op in BACKWARDS}
        self.length = len(schedule)
        for self.position, step in enumerate(schedule):
            self.current = step
            timed = self.step_timer(step) if self.step_timer is not None else nullcontext()
            with record_function(f"pipeline {step}"), timed:  # a named range per instruction in profiles
                if isinstance(step, TransferGroup):
                    self._exchange(step)
                    continue
                if isinstance(step, Overlapped):
                    self._overlapped(step, microbatches, losses)
                else:
                    self._compute(step, microbatches, losses)
        self.current = None
        self.p2p.drain()
        self._outputs.clear()
        self._weights.clear()
        return losses

    def _compute(self, inst: Instruction, microbatches, losses) -> None:
        key = (inst.chunk, inst.microbatch)
        if inst.op == "forward":
            input_tensor = self._arrived(self._inputs.pop(key, None), stage_input=True)
            if not self._forward_only and input_tensor is not None:
                self._inputs[key] = input_tensor  # its gradient is what backward sends
            output = self._forward(inst, input_tensor, microbatches, losses)
            if self._at_turn(inst.chunk):  # handed to chunk 1 here, as a leaf whose gradient comes back to us
                self._inputs[(1, inst.microbatch)] = output if self._forward_only else output.detach().requires_grad_()
                if self._forward_only:
                    return
            self._outputs[key] = output
            return
        if key in self._grads_in:
            self._grads_in[key] = self._arrived(self._grads_in[key])
        self._backward(inst, inst.microbatch == self._last_backward[inst.chunk])

    def _overlapped(self, unit: Overlapped, microbatches, losses) -> None:
        """An F&B unit: its forward on a helper thread and its backward here, taking turns at their waits, or
        (``overlap_units`` None) the forward, then the backward."""
        if self.overlap_units is None:
            for half in unit.halves:
                self._compute(half, microbatches, losses)
            return
        turns = Turns(self.overlap_units)
        turns.run(lambda: self._compute(unit.forward, microbatches, losses),
                  lambda: self._compute(unit.backward, microbatches, losses), self.turn_taking)
        self.handovers += turns.handovers

    def _exchange(self, group: TransferGroup) -> None:
        """One transfer group: sends of what was computed, receives of what comes next (waited for by the
        compute that uses them, ``_arrived``)."""
        transfers = [self._transfer(t) for t in group.transfers]
        received = iter(self.p2p.post(transfers))
        for inst in group.transfers:
            key = (inst.chunk, inst.microbatch)
            if inst.op == "recv_forward":
                self._inputs[key] = next(received)
            elif inst.op == "recv_backward":
                self._grads_in[key] = next(received)
            elif inst.op == "send_forward":
                output = self._outputs.pop(key)
                if not self._forward_only:
                    _release(output)
                    self._outputs[key] = output

    def _transfer(self, inst: Instruction) -> Transfer:
        stage, key, s = self._stage_of(inst.chunk), (inst.chunk, inst.microbatch), self.stage
        label, peer = f"{inst.label(s.virtual_pp > 1)}", self._peer(inst)
        if inst.op == "send_forward":
            return Transfer(peer, f"activation {label}", (ACTIVATION, inst.microbatch, stage + 1),
                            tensor=self._outputs[key])
        if inst.op == "send_backward":
            return Transfer(peer, f"gradient {label}", (GRADIENT, inst.microbatch, stage - 1),
                            tensor=self._grads_out.pop(key))
        forward = inst.op == "recv_forward"
        return Transfer(peer, f"{'activation' if forward else 'gradient'} {label}",
                        (ACTIVATION if forward else GRADIENT, inst.microbatch, stage),
                        shape=s.activation_shape, dtype=s.dtype)

    def _peer(self, inst: Instruction) -> int:
        """Global rank at the other end of a transfer: the neighbour holding the stage after this chunk's (sF,
        rB) or before it (rF, sB); on the V's way back up the next stage is on the previous rank."""
        s = self.stage
        ahead = inst.op in ("send_forward", "recv_backward")
        other = stage_rank(self._stage_of(inst.chunk) + (1 if ahead else -1), s.pp, s.v_shape)
        return s.next_rank if other == (s.pp_rank + 1) % s.pp else s.prev_rank

    def _backward(self, step: Instruction, is_last: bool) -> None:
        """B (the whole backward), or I (input gradient) or W (weight gradients) of a split one."""
        key = (step.chunk, step.microbatch)
        if self.on_backward is not None:
            self.on_backward(is_last)
        if step.op == "backward_weight":
            backward_weight(self._weights.pop(key))
            return
        source = self._inputs.pop(key, None)
        if step.op == "backward_input":
            grad, self._weights[key] = backward_input(self._outputs.pop(key), self._grads_in.pop(key, None), source)
        else:
            run_backward(self._outputs.pop(key), self._grads_in.pop(key, None))
            grad = source.grad if source is not None else None
        if grad is not None and step.chunk == 1 and self._at_turn(0):  # chunk 1's input came from chunk 0 here
            self._grads_in[(0, step.microbatch)] = grad
        elif grad is not None and self._stage_of(step.chunk) > 0:
            self._grads_out[key] = grad

    def _arrived(self, value, stage_input: bool = False):
        """A received tensor, waited for now if still in flight; a stage input becomes a leaf that takes a gradient."""
        if isinstance(value, Arrival):
            self.waiting = value
            value = value.wait()
            self.waiting = None
            if stage_input and not self._forward_only:
                value.requires_grad_()
        return value

    def _forward(self, instruction: Instruction, input_tensor, microbatches, losses):
        chunk = self.chunks[instruction.chunk]
        batch = microbatches[instruction.microbatch] if microbatches else {}
        output = chunk(input_tensor, batch)
        if self._stage_of(instruction.chunk) == self.num_stages - 1:
            output, value = self.loss_fn(output, batch)
            losses.append(value)
        return output

    def describe(self) -> str:
        """The step being executed, for hang and failure reports."""
        if self.current is None:
            return "idle"
        text = f"{self.current} (step {self.position + 1} of {self.length})"
        waiting = self.waiting
        if waiting is not None:
            return f"{text}, waiting for the {waiting.transfer.label} from rank {waiting.transfer.peer}"
        if not isinstance(self.current, TransferGroup):
            return text
        peers = sorted({self._peer(t) for t in self.current.transfers})
        return f"{text}, transfers with rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}"
