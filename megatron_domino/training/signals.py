"""Preemption: SIGTERM, SIGUSR1 (slurm's warning before the time limit) or SIGINT (Ctrl-C, which torchrun
forwards to every rank) asks for a checkpoint and a clean exit, so an interrupted run keeps its steps.
A second Ctrl-C exits at once without saving, for a person who will not wait (checkpoints are written
whole or not at all, so the last one stays loadable).

The handler only sets a flag. Every rank must learn whether any rank was signalled, and decide at
the same step, so all of them save the same step together. Asking with a blocking all-reduce and
``.item()`` every step would stall the host on the whole world each step. Instead, at the end of
step k ``should_stop`` launches an asynchronous MAX all-reduce of the flag (on CUDA followed by a
non-blocking copy into pinned host memory and an event) and, at the end of step k+1, reads the
result, which has long arrived by then. Every rank reads the same value at the same step: the
decision comes one step after the signal.
"""
from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from ..parallel.device import cuda

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
INTERRUPTED = 128 + signal.SIGINT  # the shell's status for a process ended by Ctrl-C
class EarlySignals:
    """Signals received before training began, kept by the run for its first steps (``remember_early_warnings``)."""

    def __init__(self):
        self.received: list[int] = []

    def take(self) -> int | None:
        """The first signal received (None: none), forgotten once taken: it is acted on once."""
        first = self.received[0] if self.received else None
        self.received.clear()
        return first


def remember_early_warnings() -> EarlySignals:
    """Call first thing: slurm's warning (SIGUSR1) may come while the run is still starting (an index build or a
    checkpoint load takes minutes at scale), where its default action would kill the rank and the job would not be
    requeued (scripts/slurm/launch.sh requeues a run that saved and exited 0). It is remembered in the returned
    ``EarlySignals``, which the run hands to its ``PreemptionHandler`` to act on at its first steps. SIGTERM and
    SIGINT keep their defaults until then: they end a start that has nothing new to save (torchrun also sends
    SIGTERM to every rank when one fails)."""
    early = EarlySignals()
    signal.signal(signal.SIGUSR1, lambda signum, frame: early.received.append(signum))
    return early


class PreemptionHandler:
    def __init__(self, device: torch.device, early: EarlySignals | None = None):
        """``early``: the signals the run remembered while it started (``remember_early_warnings``)."""
        self.received: int | None = early.take() if early is not None else None
        self._flag = torch.zeros(1, device=device)
        self._host = torch.zeros(1, pin_memory=True) if self._flag.is_cuda else self._flag
        self._copied = cuda.Event() if self._flag.is_cuda else None
        self._wait_for_flag = None  # set while a launched flag has not been read
        self._previous = {}
        for sig in PREEMPTION_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received is not None:
            os.write(2, b"second interrupt: exiting now without saving\n")
            os._exit(INTERRUPTED)
        if signum == signal.SIGINT and (not dist.is_initialized() or dist.get_rank() == 0):
            os.write(2, b"interrupt: saving a checkpoint at the next step boundary, then exiting (Ctrl-C again to "
                        b"exit now without saving)\n")
        self.received = signum

    def should_stop(self) -> bool:
        """Call on every rank once per step, at the same point: True on every rank at the same step,
        one step after any rank was signalled. Collective over the world (asynchronous)."""
        stop = False
        if self._wait_for_flag is not None:
            self._wait_for_flag()  # in steady state long complete: no stall
            stop = bool(self._host[0] > 0)
        self._wait_for_flag = None if stop else self._launch()
        return stop

    def _launch(self):
        """Start the all-reduce of this rank's flag; returns what waits for its value in ``self._host``."""
        self._flag.fill_(1.0 if self.received is not None else 0.0)
        wait = lambda: None  # noqa: E731 - a world of one: the flag is the answer
        if dist.is_initialized() and dist.get_world_size() > 1:
            wait = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True).wait
        if not self._flag.is_cuda:
            return wait
        wait()  # NCCL: the current stream waits for the all-reduce, the host does not
        self._host.copy_(self._flag, non_blocking=True)
        self._copied.record()
        return self._copied.synchronize

    def close(self, finish: bool = True) -> None:
        """Restore the previous handlers. ``finish`` (training ended normally, on every rank together) waits
        for the flag still in flight, so no collective outlives the process group; after a failure it is
        left alone, since waiting could hang when a peer has died."""
        if finish and self._wait_for_flag is not None:
            self._wait_for_flag()
        self._wait_for_flag = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
