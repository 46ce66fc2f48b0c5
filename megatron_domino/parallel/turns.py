"""Two computations taking turns at their communication waits: DualPipeV's F&B unit, overlapped.

An F&B unit runs one micro-batch's forward (F) and another's backward (B). Run in sequence, each one's exposed
communication (the Domino all-reduce that no other μ-chunk hides, the experts' all-to-all) leaves the device idle.
``Turns.run`` runs F on a helper thread and B on the caller, one at a time, handing over where either is about to
wait for its own communication: F before each Domino wait (``before_forward_wait``, called by the Domino
executor), B before each input-gradient wait of a column-parallel linear (``before_backward_wait``), and either
inside each exchange of the experts' rows (``models.expert_dispatch``). So F's transfer flies while B computes,
and B's while F computes, on one compute stream; NCCL's streams carry the transfers.

Why a thread and not a generator: F runs through whatever wraps a chunk's forward (ZeRO-3's saved-tensor hooks,
recompute, FP8), and torch keeps grad mode, saved-tensor hooks and the current CUDA stream per thread. On its own
thread F keeps its state across a handover, and B (on the caller, or on the autograd engine's device thread on
CUDA) keeps its own. The helper takes the caller's device, current stream, grad mode, outermost saved-tensor
hooks (activation offload, the rehearsal's accounting) and torch function and dispatch modes (a rehearsal's fake
tensors) when it starts.

Exactly one side runs at any time and the handovers fall at the same points of the same program on every rank,
so every rank issues its collectives in the same order (NCCL's rule), and the numbers are those of the unit run
in sequence, bit for bit: neither side reads what the other writes. A failure on either side ends both and is
raised on the caller.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch
from torch.utils import _python_dispatch

from .device import cuda

FORWARD, BACKWARD = "forward", "backward"


class _Abandoned(BaseException):
    """Raised in the forward's thread when the backward failed: it stops at its next turn."""


class Turns:
    """One F&B unit's two sides; ``handovers`` counts the turns taken (for tests and benchmarks)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.handovers = 0
        self._turn = FORWARD  # the forward starts: its first phases launch before the backward's first wait
        self._changed = threading.Condition()
        self._forward_thread: threading.Thread | None = None
        self._forward_done, self._backward_done, self._abandoned = False, False, False
        self._error: BaseException | None = None

    def run(self, forward: Callable[[], None], backward: Callable[[], None], taking: "TurnTaking") -> None:
        """Run ``forward`` on a helper thread and ``backward`` here, taking turns at the waits ``taking`` (the run's)
        announces."""
        if taking.active is not None:
            raise RuntimeError("an F&B unit is already running its halves in turns; units do not nest")
        setup = _thread_setup(self.device)
        self._forward_thread = threading.Thread(target=self._forward_side, args=(forward, setup),
                                                name="f&b-forward", daemon=True)
        taking.active = self
        try:
            self._forward_thread.start()
            self._wait_for(BACKWARD)
            backward()
        except BaseException:
            self._abandoned = True  # the forward stops at its next turn
            raise
        finally:
            self._finish_forward()
            taking.active = None
        if self._error is not None:
            raise self._error

    def _forward_side(self, forward: Callable[[], None], setup: Callable[[], list]) -> None:
        contexts = []
        try:
            contexts = setup()
            self._wait_for(FORWARD)
            if not self._abandoned:
                forward()
        except _Abandoned:
            pass
        except BaseException as error:  # raised on the caller once the backward is done
            self._error = error
        finally:
            for context in reversed(contexts):
                context.__exit__(None, None, None)
            with self._changed:
                self._forward_done, self._turn = True, BACKWARD
                self._changed.notify_all()

    def _finish_forward(self) -> None:
        """The backward is over (or failed): the forward runs its remaining phases without handing over."""
        with self._changed:
            self._backward_done, self._turn = True, FORWARD
            self._changed.notify_all()
        if self._forward_thread.ident is not None:  # started
            self._forward_thread.join()

    def _hand_to(self, side: str) -> None:
        """Give the turn to ``side`` and wait until it comes back."""
        with self._changed:
            self.handovers += 1
            self._turn = side
            self._changed.notify_all()
        self._wait_for(FORWARD if side == BACKWARD else BACKWARD)

    def _wait_for(self, side: str) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._turn == side or (side == BACKWARD and self._forward_done))
        if side == FORWARD and self._abandoned and threading.current_thread() is self._forward_thread:
            raise _Abandoned()

    def _forward_may_hand_over(self) -> bool:
        return threading.current_thread() is self._forward_thread and not self._backward_done

    def _backward_may_hand_over(self) -> bool:
        return threading.current_thread() is not self._forward_thread and not self._forward_done


class TurnTaking:
    """A run's place for its F&B unit (one per run: its parallel state's ``turns``; the pipeline runs one unit at a
    time): the waits of its layers announce themselves here, and hand over while a unit runs in turns."""

    def __init__(self):
        self.active: Turns | None = None  # the unit running in turns, if any

    def before_forward_wait(self) -> None:
        """The forward is about to wait for its communication: the backward computes meanwhile (no-op outside a
        unit)."""
        turns = self.active
        if turns is not None and turns._forward_may_hand_over():
            turns._hand_to(BACKWARD)

    def before_backward_wait(self) -> None:
        """The backward is about to wait for its communication: the forward computes meanwhile (no-op outside a
        unit)."""
        turns = self.active
        if turns is not None and turns._backward_may_hand_over():
            turns._hand_to(FORWARD)


def before_forward_wait(taking: TurnTaking | None) -> None:
    if taking is not None:
        taking.before_forward_wait()


def before_backward_wait(taking: TurnTaking | None) -> None:
    if taking is not None:
        taking.before_backward_wait()


class _Modes:
    """The caller's torch function and dispatch modes (a profiler's, a debug mode, a rehearsal's fake tensors),
    pushed onto this thread's stacks, bottom first, and popped on exit."""

    def __init__(self):
        self.functions = torch.overrides._get_current_function_mode_stack()
        self.dispatches = _python_dispatch._get_current_dispatch_mode_stack()

    def __enter__(self):
        for mode in self.functions:
            torch._C._push_on_torch_function_stack(mode)
        for mode in self.dispatches:
            _python_dispatch._push_mode(mode)
        return self

    def __exit__(self, *exc):
        for mode in reversed(self.dispatches):
            _python_dispatch._pop_mode(getattr(mode, "_mode_key", None))
        for _ in self.functions:
            torch._C._pop_torch_function_stack()


def _thread_setup(device: torch.device) -> Callable[[], list]:
    """What the forward's thread must enter first to compute as the caller would (taken on the caller now)."""
    grad = torch.is_grad_enabled()
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)  # (pack, unpack) or None
    stream = cuda.current_stream(device) if device.type == "cuda" else None
    modes = _Modes()

    def setup() -> list:
        if device.type == "cuda":  # a new thread starts on device 0
            cuda.set_device(device.index if device.index is not None else 0)
        contexts = [torch.set_grad_enabled(grad), cuda.stream(stream), modes]
        if hooks is not None:
            contexts.append(torch.autograd.graph.saved_tensors_hooks(*hooks))
        entered = []
        try:
            for context in contexts:
                context.__enter__()
                entered.append(context)
        except BaseException:
            for context in reversed(entered):
                context.__exit__(None, None, None)
            raise
        return entered

    return setup
