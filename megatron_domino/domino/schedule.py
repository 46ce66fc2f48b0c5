"""The order in which a stack of blocks computes, launches and waits, per Domino mode.

Hidden states arrive as a list of mu-chunks (batch split); each block phase computes a
chunk's partial projection and starts its all-reduce, then moves on to the next chunk. A
chunk's pending all-reduce is waited only right before that chunk's next phase needs it:

    inter-layer, 2 chunks:  A0 A1 | M0 M1 | A0' A1' ...   (A = attention, M = MLP)
    each launch overlaps the other chunk's compute, and the last chunk's MLP all-reduce
    of one layer overlaps the first chunk's attention of the next layer.

The embedding's all-reduce (first stage) enters as an in-flight chunk and the output head (last
stage) runs as a final per-chunk phase, so the first and last all-reduces overlap too.
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
    """A block phase whose projection all-reduce is in flight."""

    block: object
    pending: object
    bias: object
    residual: torch.Tensor

    def finish(self) -> torch.Tensor:
        return self.block.residual(self.pending.wait(), self.bias, self.residual)


@dataclass
class _Ready:
    value: torch.Tensor

    def finish(self) -> torch.Tensor:
        return self.value


def _phase(block, phase, x, rotary, mask, asynchronous: bool, column_pieces: int):
    hidden = block.phase_hidden(phase, x, rotary, mask)
    projection = block.projection(phase)
    if asynchronous:
        pending, bias = projection.launch(hidden, column_pieces)
        return _InFlight(block, pending, bias, x)
    return _Ready(block.residual(*projection(hidden), x))


def run_blocks(blocks, chunks: list, contexts: list[tuple], *, asynchronous: bool, column_pieces: int = 1,
               overlap: str = "inter", head=None) -> list[torch.Tensor]:
    """Run ``blocks`` (then ``head(x, chunk_index)``, if given) over every chunk.

    ``chunks[i]`` is a tensor or something still in flight (an object with ``finish()``, such as
    the embedding's all-reduce); ``contexts[i]`` = (rotary, attention_mask) of chunk i.
    """
    pending = [c if hasattr(c, "finish") else _Ready(c) for c in chunks]
    marks = []  # where each (phase, chunk) computation started, in autograd's creation order

    def compute(i: int, function) -> None:
        x = pending[i].finish()
        if asynchronous:
            marks.append(sequence_mark())
        with recording_gradient_waits() as waits:
            result = function(x)
        if asynchronous:  # backward mirrors forward: wait k - 1 computations later
            defer_waits(waits, marks[max(0, len(marks) - len(pending))])
        pending[i] = result if hasattr(result, "finish") else _Ready(result)

    for block in blocks:
        for phase in PHASES:
            for i, (rotary, mask) in enumerate(contexts):
                compute(i, lambda x: _phase(block, phase, x, rotary, mask, asynchronous, column_pieces))
        if overlap == "intra":
            pending = [_Ready(p.finish()) for p in pending]
    if head is not None:
        for i in range(len(pending)):
            compute(i, lambda x: head(x, i))
    return [p.finish() for p in pending]
