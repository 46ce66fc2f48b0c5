"""The bad-step guard (train.on_bad_step): a non-finite loss or grad norm, or a loss spike, never reaches the weights.

The check runs inside the optimizer step, after the global grad norm and before clipping and the update,
so a bad step can be dropped by not applying it. Every rank decides from the same numbers: the loss is
the global-batch mean and the norm the global one, both shared by every rank, and the running median is
kept from them, so all ranks skip or stop together without an extra collective.

Cost: one host read of two scalars per step (loss and norm), only while the guard is on; with it off
nothing here runs and steady-state steps stay free of host syncs. Only when a step is bad do the ranks
all-reduce one flag each (whose own gradient shard was non-finite) to name the first rank that saw it.

``rerun`` (Megatron's re-run of a suspect step): the refused step runs once more on the same micro-batches from
the same state (the update was not applied) and the same random streams, so a healthy machine repeats it bit for
bit. Bad again: the data or the model is at fault (``train.on_bad_step_after_rerun`` skips or stops, naming the
step's documents). Good this time: the first attempt met a transient fault (a bit flip, a flaky GPU); the rank
that saw it and its host are logged, and the rerun's update is applied.
"""
from __future__ import annotations

import math
import socket
import statistics
from collections import deque

import torch
import torch.distributed as dist

from ..config.errors import KnownError


class BadStepError(KnownError):
    """train.on_bad_step=stop: the run stopped at a bad step, after saving the last good one."""


class BadStepGuard:
    """Decides per step whether the update may be applied; counts and describes the steps it refused."""

    def __init__(self, action: str, spike_factor: float | None, spike_window: int, rank: int, world_size: int,
                 after_rerun: str = "stop"):
        self.action, self.spike_factor, self.reproduced_action = action, spike_factor, after_rerun
        self.rank, self.world_size = rank, world_size
        self.recent: deque[float] = deque(maxlen=spike_window)
        self.skipped = 0
        self.problem: str | None = None  # why the step being judged was refused; None: it was not
        self.verdict: str | None = None  # what happens to it: skip, stop, rerun (first attempt) or transient
        self.first_rank: int | None = None  # the lowest rank whose own gradient was non-finite, if one was

    def judge(self, step: int, loss: torch.Tensor):
        """The optimizer's ``accept`` for step ``step`` (see DistributedOptimizer.step); sets ``problem``."""
        self.problem = self.verdict = None
        return lambda norm, local_squared: self._accept(step, loss, norm, local_squared)

    def _accept(self, step: int, loss: torch.Tensor, norm: torch.Tensor, local_squared: torch.Tensor) -> bool:
        """Whether the step may update the weights. Collective only when it may not (on every rank alike)."""
        loss_value, norm_value = torch.stack([loss.detach().float(), norm.float()]).tolist()
        reason = self._reason(loss_value, norm_value)
        if reason is None:
            self.recent.append(loss_value)
            return True
        self.skipped += self.action == "skip"
        self.problem = f"bad step {step}: {reason}, first seen on {self._first_rank(local_squared)}"
        self.verdict = self.action
        return False

    def after_rerun(self, first_problem: str, documents: str) -> None:
        """Judge a rerun of the step refused for ``first_problem`` (this step's ``problem`` is the rerun's now);
        ``documents`` names what the step trained on. Collective on every rank for a transient fault (hosts)."""
        if self.problem is not None:
            self.verdict = self.reproduced_action
            self.skipped += self.verdict == "skip"
            self.problem = (f"{self.problem}; the rerun on the same data reproduced it: the data or the model, not the "
                            f"machine ({documents})")
            return
        where = "no single rank (the global loss)"
        if self.first_rank is not None:
            hosts = [socket.gethostname()] * self.world_size
            if self.world_size > 1:
                dist.all_gather_object(hosts, socket.gethostname())
            where = f"rank {self.first_rank}, host {hosts[self.first_rank]}"
        self.verdict = "transient"
        self.problem = (f"{first_problem}; the rerun on the same data did not reproduce it: a transient fault on "
                        f"{where}; the rerun's update was applied")

    def _reason(self, loss: float, norm: float) -> str | None:
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if not math.isfinite(norm):
            return f"grad norm is {norm}"
        if self.spike_factor is not None and len(self.recent) == self.recent.maxlen:
            median = statistics.median(self.recent)
            if loss > self.spike_factor * median:
                return (f"loss {loss:.4f} is above train.spike_factor = {self.spike_factor} x the median "
                        f"{median:.4f} of the last {len(self.recent)} steps")
        return None

    def _first_rank(self, local_squared: torch.Tensor) -> str:
        """The lowest global rank whose own part of the gradient norm was non-finite (a loss spike or a
        non-finite loss with finite gradients is a global value: every rank saw it at once)."""
        flags = torch.zeros(self.world_size, device=local_squared.device)
        flags[self.rank] = float(not torch.isfinite(local_squared).item())
        if self.world_size > 1:
            dist.all_reduce(flags)
        ranks = flags.nonzero().flatten().tolist()
        self.first_rank = ranks[0] if ranks else None
        return f"rank {ranks[0]} (gradient)" if ranks else "every rank (the global loss)"

    def stop_error(self, saved: bool) -> BadStepError:
        where = ("after saving the last good step" if saved else "without a checkpoint (checkpoint.dir is unset)")
        setting = "train.on_bad_step_after_rerun=stop" if self.action == "rerun" else "train.on_bad_step=stop"
        return BadStepError(f"{self.problem}. The run stopped ({setting}) {where}. Fix: resume with a lower "
                            f"optimizer.lr or another train.seed, or set {setting[:-4]}skip to drop such steps and "
                            "go on")
