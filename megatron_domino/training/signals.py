"""Preemption: SIGTERM or SIGUSR1 (slurm's warning before the time limit) asks for a checkpoint and a clean exit.

The handler only sets a flag. At each step boundary every rank learns, through one small
all-reduce, whether any rank was signalled, so all of them save the same step together.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHandler:
    def __init__(self):
        self.received: int | None = None
        self._previous = {}
        for sig in PREEMPTION_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = signum

    def should_stop(self, device: torch.device) -> bool:
        """Collective over the world: True on every rank when any rank was signalled."""
        flag = torch.tensor([1.0 if self.received is not None else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
