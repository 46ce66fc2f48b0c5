"""The training line and record every ``log.interval`` steps: loss, learning rate, gradient norm, throughput,
MFU, memory, ETA, and the MoE and timer details when they apply."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..parallel.device import cuda
from .metrics import format_train_line, memory_gib


@dataclass(frozen=True)
class StepRecord:
    """What one step leaves for the log; its tensors are read on the host only when a window ends."""

    step: int  # steps done
    loss: torch.Tensor
    lr: float
    grad_norm: torch.Tensor | None
    consumed_samples: int
    skipped_steps: int  # steps not applied so far (fp16 overflows, the bad-step guard's refusals)
    mtp_loss: torch.Tensor | None = None  # multi-token prediction's loss per depth
    loss_scale: float | None = None  # fp16's


class StepLog:
    """Times windows of steps that end where ``logs(step)`` (``cadence.StepCadence.logs``), closed by a device sync
    so that they include the queued GPU work, and writes one record per window through ``write(record, line)``;
    ``window_extras()`` adds what is read only then (MoE balance, packing imbalance, timers). ``tokens_per_step``
    and ``flops_per_step`` are the job's; ``peak`` the device's TFLOP/s (None: no MFU)."""

    def __init__(self, *, logs: Callable[[int], bool], steps: int, first_step: int, tokens_per_step: int,
                 flops_per_step: float, world_size: int, peak: float | None, device: torch.device,
                 write: Callable[[dict, str], None], window_extras: Callable[[], dict]):
        self.logs, self.steps, self.world_size, self.peak, self.device = logs, steps, world_size, peak, device
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.write, self.window_extras = write, window_extras
        self.start = self.window_start = time.perf_counter()
        self.first_step, self.window_steps = first_step, 0

    def after_step(self, record: StepRecord) -> None:
        """Count the step; at the end of a window, write its record."""
        self.window_steps += 1
        if not self.logs(record.step):
            return
        if self.device.type == "cuda":
            cuda.synchronize(self.device)
        now = time.perf_counter()
        step_time = (now - self.window_start) / self.window_steps
        self._write(record, step_time, (now - self.start) / (record.step - self.first_step))
        self.window_start, self.window_steps = time.perf_counter(), 0

    def _write(self, step: StepRecord, step_time: float, mean_step_time: float) -> None:
        in_use, peak_mem = memory_gib(self.device)
        tflops = self.flops_per_step / step_time / self.world_size / 1e12
        record = {"step": step.step, "loss": step.loss.item(), "lr": step.lr,
                  "grad_norm": step.grad_norm.item() if step.grad_norm is not None else None,
                  "skipped_steps": step.skipped_steps, "tokens_per_s": self.tokens_per_step / step_time,
                  "tflops_per_device": tflops, "mfu": tflops / self.peak if self.peak else None,
                  "mem_gib": in_use, "mem_peak_gib": peak_mem, "step_time_s": step_time,
                  "eta_s": mean_step_time * (self.steps - step.step), "consumed_samples": step.consumed_samples,
                  "loss_scale": step.loss_scale,
                  "mtp_loss": step.mtp_loss.item() if step.mtp_loss is not None else None}
        record = {k: v for k, v in {**record, **self.window_extras()}.items() if v is not None}
        self.write(record, format_train_line(record, self.steps))
