"""The training line and record every ``log.interval`` steps: loss, learning rate, gradient norm, throughput,
MFU, memory, ETA, and the MoE and timer details when they apply."""
from __future__ import annotations

import time

from ..models.counters import flops_per_token
from ..parallel.device import cuda
from .metrics import device_peak_tflops, format_train_line, memory_gib
from .moe_metrics import moe_metrics


class StepLog:
    """Times windows of ``log.interval`` steps (closed by a device sync, so they include the queued GPU work)
    and writes one record per window through ``metrics``; the values are read on the host only then."""

    def __init__(self, cfg, trainer):
        self.cfg, self.trainer = cfg, trainer
        self.tokens_per_step = trainer.cadence.tokens_per_step
        self.flops_per_step = flops_per_token(cfg.model, cfg.model.seq_length) * self.tokens_per_step
        self.peak = device_peak_tflops(trainer.device, cfg.log.peak_tflops)
        self.start = self.window_start = time.perf_counter()
        self.first_step, self.window_steps = trainer.step, 0

    def after_step(self, result: dict) -> None:
        """Count the step; at the end of a window, write its record."""
        trainer = self.trainer
        self.window_steps += 1
        if not trainer.cadence.logs(trainer.step):
            return
        if trainer.device.type == "cuda":
            cuda.synchronize(trainer.device)
        now = time.perf_counter()
        step_time = (now - self.window_start) / self.window_steps
        self._write(result, step_time, (now - self.start) / (trainer.step - self.first_step))
        self.window_start, self.window_steps = time.perf_counter(), 0

    def _write(self, result: dict, step_time: float, mean_step_time: float) -> None:
        trainer, cfg = self.trainer, self.cfg
        in_use, peak_mem = memory_gib(trainer.device)
        tflops = self.flops_per_step / step_time / trainer.state.topology.world_size / 1e12
        grad_norm = result["grad_norm"].item() if result["grad_norm"] is not None else None
        guard = trainer.guard
        record = {"step": trainer.step, "loss": result["loss"].item(), "lr": result["lr"], "grad_norm": grad_norm,
                  "skipped_steps": trainer.optimizer.skipped_steps + (guard.skipped if guard else 0),
                  "tokens_per_s": self.tokens_per_step / step_time,
                  "tflops_per_device": tflops, "mfu": tflops / self.peak if self.peak else None,
                  "mem_gib": in_use, "mem_peak_gib": peak_mem, "step_time_s": step_time,
                  "eta_s": mean_step_time * (cfg.train.steps - trainer.step),
                  "consumed_samples": trainer.data.consumed}
        if cfg.train.fp16:
            record["loss_scale"] = trainer.optimizer.loss_scale
        if result.get("mtp_loss") is not None:  # multi-token prediction's loss per depth, logged on its own
            record["mtp_loss"] = result["mtp_loss"].item()
        if trainer.data.balancer is not None:  # balanced packing: the window's imbalance before and after
            record.update(trainer.data.balancer.take())
        if cfg.model.num_experts:
            record.update(moe_metrics(trainer.chunks, cfg.model, trainer.device))
        if cfg.log.timers:
            trainer.timers.add("p2p-wait", trainer.engine.executor.p2p.take_wait_seconds())
            record["timers_ms"] = trainer.timers.report()
        trainer.metrics.write({k: v for k, v in record.items() if v is not None},
                              format_train_line(record, cfg.train.steps))
