"""The order in which a stack of blocks computes, launches and waits, per Domino mode.

Hidden states arrive as a list of mu-chunks (batch split); each block phase computes a
chunk's partial projection and starts its all-reduce, then moves on to the next chunk. A
chunk's pending all-reduce is waited only right before that chunk's next phase needs it:

    inter-layer, 2 chunks:  A0 A1 | M0 M1 | A0' A1' ...   (A = attention, M = MLP)
    each launch overlaps the other chunk's compute, and the last chunk's MLP all-reduce
    of one layer overlaps the first chunk's attention of the next layer.

Intra-layer mode waits for every chunk at the end of each layer instead. With one chunk and
Domino off the same loop is Megatron's synchronous TP (the projection reduces in place).

Backward mirrors forward in both modes: each chunk's input-gradient all-reduce is waited only
after the other chunks' next computation (see ``async_comm.defer_waits``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .async_comm import defer_waits, recording_gradient_waits, sequence_mark

PHASES = ("attention", "mlp")  # the two communicating phases of a block, in order


@dataclass
class _InFlight:
    block: object
    pending: object
    bias: object
    residual: torch.Tensor

    def finish(self) -> torch.Tensor:
        return self.block.residual(self.pending.wait(), self.bias, self.residual)


def run_blocks(blocks, chunks: list[torch.Tensor], contexts: list[tuple], *, asynchronous: bool,
               column_pieces: int = 1, overlap: str = "inter") -> list[torch.Tensor]:
    """Run ``blocks`` over every chunk; ``contexts[i]`` = (rotary, attention_mask) of chunk i."""
    chunks = list(chunks)
    in_flight: list[_InFlight | None] = [None] * len(chunks)
    marks = []  # where each (phase, chunk) computation started, in autograd's creation order
    for block in blocks:
        for phase in PHASES:
            for i, (rotary, mask) in enumerate(contexts):
                if in_flight[i] is not None:
                    chunks[i], in_flight[i] = in_flight[i].finish(), None
                if asynchronous:
                    marks.append(sequence_mark())
                with recording_gradient_waits() as waits:
                    hidden = block.phase_hidden(phase, chunks[i], rotary, mask)
                if asynchronous:  # backward mirrors forward: wait k - 1 computations later
                    defer_waits(waits, marks[max(0, len(marks) - len(contexts))])
                projection = block.projection(phase)
                if asynchronous:
                    pending, bias = projection.launch(hidden, column_pieces)
                    in_flight[i] = _InFlight(block, pending, bias, chunks[i])
                else:
                    chunks[i] = block.residual(*projection(hidden), chunks[i])
        if overlap == "intra":
            chunks = _finish_all(chunks, in_flight)
    return _finish_all(chunks, in_flight)


def _finish_all(chunks, in_flight):
    for i, flight in enumerate(in_flight):
        if flight is not None:
            chunks[i], in_flight[i] = flight.finish(), None
    return chunks
