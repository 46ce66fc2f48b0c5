"""Domino's order as data: when each μ-chunk's phase computes and launches its all-reduce, and when it waits.

A stage's forward under Domino is a list of ``Step``s over (layer, phase, chunk):
- ``launch``: compute the phase for the chunk (up to its row-parallel projection) and start the
  projection's all-reduce (reduce-scatter under SP) without waiting;
- ``wait``: wait for that all-reduce and finish the phase (bias, dropout, residual);
- ``compute``: the output head, which has no all-reduce to hide (its loss reduces synchronously).
The embedding (first stage) launches its all-reduce per chunk too, so it overlaps the first layer.

Inter-layer overlap waits for a chunk's all-reduce only right before that chunk's next launch, so
the last chunk's MLP all-reduce of one layer hides behind the first chunk's attention of the next.
Intra-layer overlap waits for every chunk at the end of each layer.

    inter, 2 chunks:  E0> E1> | E0 A0> E1 A1> | A0 M0> A1 M1> | M0 A0'> ...    (X> launch, X wait)

Under Ulysses, ``attention_apart`` makes the attention core (up to its output all-to-alls, ``C``) a phase of its
own: ``C0> C1> | C0 A0> C1 A1> | A0 M0> ...``, so a chunk's output exchange flies during the next chunk's core.

Backward mirrors forward: a launch's backward starts its input-gradient all-reduce, and the wait
for it runs after the backward of the other chunks' next computation (``backward_order``; the
executor sets the autograd priorities that make it so).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config.schema import DOMINO_OVERLAPS

EMBEDDING, ATTENTION, MLP, HEAD = "embedding", "attention", "mlp", "head"
ATTENTION_CORE = "attention core"  # Ulysses' attention up to its output all-to-alls (``attention_apart``)
BLOCK_PHASES = (ATTENTION, MLP)  # the two communicating phases of a block, in order
_SHORT = {EMBEDDING: "E", ATTENTION: "A", MLP: "M", HEAD: "H", ATTENTION_CORE: "C"}


@dataclass(frozen=True)
class Step:
    op: str  # launch | wait | compute
    phase: str  # embedding | attention | mlp | head
    chunk: int
    layer: int = -1  # index into this stage's blocks; -1 for the embedding and the head

    def label(self) -> str:
        """'A1.0>' (launch layer 1's attention for chunk 0), 'M1.0' (wait for it), 'H0' (the head)."""
        where = _SHORT[self.phase] + (f"{self.layer}." if self.layer >= 0 else "") + str(self.chunk)
        return where + (">" if self.op == "launch" else "")

    def trace_name(self) -> str:
        """'launch layer 3 mlp chunk 1': how profiles and benchmark traces name this step."""
        layer = f" layer {self.layer}" if self.layer >= 0 else ""
        return f"{self.op}{layer} {self.phase} chunk {self.chunk}"


def forward_order(num_layers: int, chunks: int, overlap: str = "inter", embedding: bool = False,
                  head: bool = False, attention_apart: bool = False) -> list[Step]:
    """The forward steps of a stage with ``num_layers`` blocks (and the embedding / head when it holds them).
    ``attention_apart`` (``parallel.cp_a2a_output_overlap``): each block's attention core is a phase of its own,
    launched for every chunk before any chunk's projection, so that a chunk's Ulysses output all-to-alls fly
    while the next chunk's core computes (``C0.0> C0.1> A0.0> A0.1>``); the projection's all-reduce then hides
    behind the other chunk's projection only, not its whole attention."""
    if overlap not in DOMINO_OVERLAPS:
        raise ValueError(f"parallel.domino_overlap = {overlap!r}: must be one of {DOMINO_OVERLAPS}. "
                         f"Fix: use 'inter'.")
    if chunks < 1 or num_layers < 0:
        raise ValueError(f"a Domino order needs chunks >= 1 and num_layers >= 0, got {chunks} and {num_layers}")
    order: list[Step] = []
    in_flight: list[Step | None] = [None] * chunks  # per chunk: the launch not yet waited for

    def wait(chunk: int) -> None:
        if in_flight[chunk] is not None:
            launched = in_flight[chunk]
            order.append(Step("wait", launched.phase, chunk, launched.layer))
            in_flight[chunk] = None

    def launch(phase: str, chunk: int, layer: int = -1) -> None:
        wait(chunk)
        order.append(Step("launch", phase, chunk, layer))
        in_flight[chunk] = order[-1]

    if embedding:
        for chunk in range(chunks):
            launch(EMBEDDING, chunk)
    phases = (ATTENTION_CORE,) + BLOCK_PHASES if attention_apart else BLOCK_PHASES
    for layer in range(num_layers):
        for phase in phases:
            for chunk in range(chunks):
                launch(phase, chunk, layer)
        if overlap == "intra":
            for chunk in range(chunks):
                wait(chunk)
    for chunk in range(chunks):
        wait(chunk)
        if head:
            order.append(Step("compute", HEAD, chunk))
    return order


def backward_order(order: list[Step], chunks: int) -> list[str]:
    """The backward that the executor's priorities produce, as labels: each launch or compute in reverse,
    its column-parallel input-gradient all-reduce ('~' + label; the embedding has none, nor an attention launch
    whose core ran apart) waited once the other chunks' next computation is done."""
    computations = [s for s in order if s.op != "wait"]
    apart = any(s.phase == ATTENTION_CORE for s in order)  # the attention launch then only projects
    lines, deferred = [], []
    for index, step in enumerate(reversed(computations)):
        lines.append(step.label().rstrip(">") + "'")
        if step.phase != EMBEDDING and not (apart and step.phase == ATTENTION):
            deferred.append((index + chunks - 1, "~" + step.label().rstrip(">")))
        lines += [label for due, label in deferred if due == index]
        deferred = [(due, label) for due, label in deferred if due != index]
    return lines + [label for _, label in deferred]


def render(order: list[Step], chunks: int) -> str:
    """Forward and backward on two lines, in the notation of the module docstring."""
    return "forward:  " + " ".join(s.label() for s in order) + "\nbackward: " + " ".join(backward_order(order, chunks))
