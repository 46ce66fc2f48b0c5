"""Which steps do what beyond training: log, evaluate, save, exit; and so which read values on the host.

A steady-state step never waits for the GPU (docs/design/nccl-rules.md: "No host syncs in a steady-state step"); the
steps that log, evaluate, save or end the run read values on the host by design, and so does every step under the
bad-step guard (two scalars). ``log.sync_debug`` turns any other host sync into an error on CUDA.
"""
from __future__ import annotations

from ..parallel.device import cuda


class StepCadence:
    def __init__(self, cfg, device, guarded: bool):
        self.cfg, self.device, self.guarded = cfg, device, guarded
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length

    def done(self, step: int) -> bool:
        """``train.steps`` reached, or ``train.tokens`` seen."""
        train = self.cfg.train
        return step >= train.steps or (train.tokens is not None and step * self.tokens_per_step >= train.tokens)

    def logs(self, step: int) -> bool:
        """Every ``log.interval`` steps, and the last."""
        return step % self.cfg.log.interval == 0 or step == self.cfg.train.steps

    def evaluates(self, step: int) -> bool:
        interval = self.cfg.train.eval_interval
        return bool(interval) and step % interval == 0

    def exits(self, step: int) -> bool:
        """``train.exit_interval``: save and stop here (a job split into allocations)."""
        interval = self.cfg.train.exit_interval
        return bool(interval) and step % interval == 0

    def saves(self, step: int) -> bool:
        interval = self.cfg.checkpoint.interval
        return bool(interval) and step % interval == 0 and step < self.cfg.train.steps

    def reads_host(self, step: int) -> bool:
        """Whether ``step`` reads values on the host by design."""
        cfg, train = self.cfg, self.cfg.train
        periodic = (cfg.log.interval, train.eval_interval, cfg.checkpoint.interval, train.exit_interval,
                    cfg.log.straggler_interval)
        return self.guarded or self.done(step) or any(k and step % k == 0 for k in periodic)

    def sync_debug(self, steady: bool) -> None:
        """log.sync_debug on CUDA: a host sync raises while ``steady`` (torch's sync debug mode), so a run
        proves its steady-state steps never wait for the GPU."""
        if self.cfg.log.sync_debug and self.device.type == "cuda":
            cuda.set_sync_debug_mode("error" if steady else "default")
