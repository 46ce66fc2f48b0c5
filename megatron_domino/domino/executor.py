"""Runs a Domino order (``order.forward_order``) over a stage's blocks: one loop, one step at a time.

Each chunk is either ready (a tensor) or in flight (a launched phase whose all-reduce has not been
waited for). A ``launch`` step computes a phase from the chunk's ready state and leaves it in
flight; a ``wait`` step finishes it. The block's own pieces do the work (``phase_hidden``, the
projection's ``launch``, ``residual``), the same ones its synchronous ``forward`` uses.

Backward mirrors forward: the input-gradient waits that a computation's column-parallel linears
create are given the autograd priority of the computation ``chunks - 1`` steps earlier, so each
wait runs after the other chunks' next backward (``order.backward_order`` prints the result).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.profiler import record_function

from ..parallel import turns
from ..tensor_parallel.async_comm import WaitForInputGradient
from .order import ATTENTION_CORE, EMBEDDING, HEAD, Step


@dataclass
class InFlight:
    """A block phase whose projection all-reduce is in flight; ``finish`` waits and adds the residual."""

    block: object
    pending: object
    bias: object
    residual: torch.Tensor

    def finish(self) -> torch.Tensor:
        return self.block.residual(self.pending.wait(), self.bias, self.residual)


def sequence_mark() -> int | None:
    """The autograd engine's current node sequence number (its backward priority: higher runs first)."""
    if not torch.is_grad_enabled():
        return None
    return torch.zeros((), requires_grad=True).clone().grad_fn._sequence_nr()


def set_backward_priority(nodes: list, sequence_nr: int | None) -> None:
    """Give autograd nodes the backward priority of another point in forward (``sequence_mark``).

    Autograd runs ready nodes latest-created first, so a wait created right before its linear
    would run right after it. Domino gives its waits an earlier point's number: the engine runs
    the other mu-chunks' backward while the all-reduce flies. Ulysses gives early-joined queries
    a later point's: their gradient leaves when their slice's attention backward is done.
    Dependencies still order everything that consumes a gradient.
    """
    if sequence_nr is None:
        return
    for node in nodes:
        if hasattr(node, "_set_sequence_nr"):  # a private torch hook; without it the order is autograd's own
            node._set_sequence_nr(sequence_nr)


@dataclass
class CoreInFlight:
    """A block's attention core run apart (``order.ATTENTION_CORE``): its Ulysses output all-to-alls in flight
    (``pending``, a ``models.ulysses.OutputInFlight``); ``finish`` waits for them."""

    pending: object
    residual: torch.Tensor

    def finish(self) -> "CoreArrived":
        return CoreArrived(self.pending.wait(), self.residual)


@dataclass
class CoreArrived:
    """The attention core's output, arrived: the attention phase's launch only projects it."""

    hidden: torch.Tensor
    residual: torch.Tensor


def launch_phase(block, phase: str, x, context, column_pieces: int) -> InFlight | CoreInFlight:
    """Compute ``phase`` of ``block`` up to its row-parallel projection and start the projection's all-reduce
    (the attention core apart: up to its output all-to-alls, and start those)."""
    if phase == ATTENTION_CORE:
        return CoreInFlight(block.attention_in_flight(x, context), x)
    if isinstance(x, CoreArrived):
        hidden, x = x.hidden, x.residual
    else:
        hidden = block.phase_hidden(phase, x, context)
    pending, bias = block.projection(phase).launch(hidden, column_pieces)
    return InFlight(block, pending, bias, x)


def _gradient_waits(result, since: int | None) -> list:
    """The input-gradient wait nodes created since sequence number ``since`` in ``result``'s graph."""
    if since is None:
        return []
    roots = [result] if torch.is_tensor(result) else [getattr(result, "pending", None)]
    frontier = [t.grad_fn for root in roots for t in _tensors(root) if t.grad_fn is not None]
    found, seen = [], set()
    while frontier:
        node = frontier.pop()
        if node is None or node in seen or not hasattr(node, "_sequence_nr") or node._sequence_nr() < since:
            continue
        seen.add(node)
        if isinstance(node, WaitForInputGradient._backward_cls):
            found.append(node)
        frontier += [next_node for next_node, _ in node.next_functions]
    return found


def _tensors(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    return [p for p in getattr(value, "pieces", []) if torch.is_tensor(p)]


def run_order(order: list[Step], blocks, inputs: list, contexts: list, *, column_pieces: int = 1,
              embed: Callable | None = None, head: Callable | None = None, taking=None) -> list[torch.Tensor]:
    """Execute ``order``; returns each chunk's final state.

    ``inputs[c]``: chunk c's hidden state (unused where the order launches the embedding); ``contexts[c]``:
    its tokens' context (``models.tokens.TokenContext``), handed to every block; ``embed(c)`` launches chunk
    c's embedding (something with ``finish()``); ``head(x, c)`` is the output head. Each step runs in a
    profiler range named by ``Step.trace_name``. ``taking``: the run's ``parallel.turns.TurnTaking``, told of each
    wait (an F&B unit's backward computes meanwhile).
    """
    chunks = len(contexts)
    state = list(inputs) + [None] * (chunks - len(inputs))
    marks: list[int | None] = []
    for step in order:
        with record_function(f"domino {step.trace_name()}"):  # a named range per step in profiles
            c = step.chunk
            if step.op == "wait":
                turns.before_forward_wait(taking)  # in an overlapped F&B unit, the backward computes meanwhile
                state[c] = state[c].finish()
                continue
            marks.append(sequence_mark())
            if step.phase == EMBEDDING:
                result = embed(c)
            elif step.phase == HEAD:
                result = head(state[c], c)
            else:
                result = launch_phase(blocks[step.layer], step.phase, state[c], contexts[c], column_pieces)
            set_backward_priority(_gradient_waits(result, marks[-1]), marks[max(0, len(marks) - chunks)])
            state[c] = result
    return state
