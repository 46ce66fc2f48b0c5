"""Runs one rank's instruction list: forward/backward of model chunks and the p2p between them.

The executor holds no scheduling logic: the order comes from ``schedules.build_schedule``.
It keeps at most the activations the schedule has in flight, releases each sent output's
data (only its autograd graph stays), and tells the gradient synchroniser which backward is
the last of the step so DP reductions overlap the cool-down. A failure names the instruction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.autograd import Variable

from .p2p import ACTIVATION_TAG, GRADIENT_TAG, P2P
from .schedules import Instruction, virtual_stage


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


def _release(output: torch.Tensor) -> None:
    """Free an activation's storage but keep its autograd graph (backward gets the gradient explicitly)."""
    output.data = torch.empty((1,), dtype=output.dtype, device=output.device)


def _backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Backward from an output whose data may have been released (torch.autograd.backward checks shapes)."""
    if grad is None:
        grad = torch.ones_like(output)
    Variable._execution_engine.run_backward((output,), (grad,), False, False, (), True, True)


class PipelineExecutor:
    def __init__(self, chunks: list, stage: StageContext, p2p: P2P, *,
                 loss_fn: Callable, on_backward: Callable[[bool], None] | None = None):
        """``loss_fn(per_token_loss, batch) -> (loss_to_backprop, detached loss sum)`` on the last stage;
        ``on_backward(is_last)`` is called before every backward (the DP gradient sync's hook)."""
        self.chunks, self.stage, self.p2p = chunks, stage, p2p
        self.loss_fn, self.on_backward = loss_fn, on_backward
        self.num_stages = stage.pp * stage.virtual_pp
        self.current: Instruction | None = None
        self.position, self.length = 0, 0

    def _stage_of(self, chunk: int) -> int:
        return virtual_stage(self.stage.pp_rank, chunk, self.stage.pp)

    def run(self, schedule: list[Instruction], microbatches: list[dict]) -> list[torch.Tensor]:
        """Execute ``schedule``; returns the detached loss sums of the micro-batches whose loss lives here."""
        inputs, outputs, grads_in, grads_out, losses = {}, {}, {}, {}, []
        last_backward = {c: max(i.microbatch for i in schedule if i.op == "backward" and i.chunk == c)
                         for c in range(self.stage.virtual_pp) if any(i.chunk == c for i in schedule)}
        self.length = len(schedule)
        for self.position, instruction in enumerate(schedule):
            self.current = instruction
            key, op = (instruction.chunk, instruction.microbatch), instruction.op
            if op == "recv_forward":
                inputs[key] = self.p2p.recv(self.stage.activation_shape, self.stage.dtype, self.stage.prev_rank,
                                            ACTIVATION_TAG, f"activation {instruction}").requires_grad_()
            elif op == "forward":
                outputs[key] = self._forward(instruction, inputs.get(key), microbatches, losses)
            elif op == "send_forward":
                self.p2p.send(outputs[key], self.stage.next_rank, ACTIVATION_TAG)
                _release(outputs[key])
            elif op == "recv_backward":
                grads_in[key] = self.p2p.recv(self.stage.activation_shape, self.stage.dtype, self.stage.next_rank,
                                              GRADIENT_TAG, f"gradient {instruction}")
            elif op == "backward":
                if self.on_backward is not None:
                    self.on_backward(instruction.microbatch == last_backward[instruction.chunk])
                _backward(outputs.pop(key), grads_in.pop(key, None))
                source = inputs.pop(key, None)
                if source is not None and self._stage_of(instruction.chunk) > 0:
                    grads_out[key] = source.grad
            elif op == "send_backward":
                self.p2p.send(grads_out.pop(key), self.stage.prev_rank, GRADIENT_TAG)
            self.p2p.prune()
        self.current = None
        self.p2p.drain()
        return losses

    def _forward(self, instruction: Instruction, input_tensor, microbatches, losses):
        chunk = self.chunks[instruction.chunk]
        batch = microbatches[instruction.microbatch] if microbatches else {}
        output = chunk(input_tensor, batch)
        if self._stage_of(instruction.chunk) == self.num_stages - 1:
            output, loss_sum = self.loss_fn(output, batch)
            losses.append(loss_sum)
        return output

    def describe(self) -> str:
        """The instruction being executed, for hang and failure reports."""
        if self.current is None:
            return "idle"
        text = f"{self.current} (op {self.current.op}, instruction {self.position + 1} of {self.length})"
        peer = {"recv_forward": self.stage.prev_rank, "recv_backward": self.stage.next_rank}.get(self.current.op)
        return text if peer is None else f"{text}, waiting for rank {peer}"
