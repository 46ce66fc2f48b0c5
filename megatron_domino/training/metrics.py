"""Console lines, metrics.jsonl and TensorBoard scalars, from one rank (the last stage's first rank).

Throughput figures are derived here: tokens/s from the global batch, TFLOP/s per device from
the analytic FLOP counter, MFU against the device's peak (known GPUs, or log.peak_tflops).
"""
from __future__ import annotations

import json
import os
import resource
import time

import torch

from ..config.errors import ConfigError
from ..parallel.device import cuda
from .moe_metrics import format_moe

# Dense bf16 peak TFLOP/s per device, by a substring of the device name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}


def device_peak_tflops(device: torch.device, configured: float | None) -> float | None:
    if configured:
        return configured
    if device.type != "cuda":
        return None
    name = cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def memory_gib(device: torch.device) -> tuple[float, float]:
    """(in use, peak) in GiB: the CUDA allocator on GPUs, the process's resident set on the CPU."""
    if device.type == "cuda":
        return cuda.memory_allocated(device) / 2**30, cuda.max_memory_allocated(device) / 2**30
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return resident / 2**30, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Timers:
    """Wall-clock totals per named region since the last report.

    On CUDA a region only ends when its kernels do, which needs a device synchronisation: that is
    done only when timers were asked for (log.timers), so normal steps keep their overlap.
    """

    def __init__(self, device: torch.device, synchronize: bool = False):
        self.device, self.totals, self._starts = device, {}, {}
        self.synchronize = synchronize and device.type == "cuda"

    def start(self, name: str) -> None:
        self._starts[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.synchronize:
            cuda.synchronize(self.device)
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - self._starts.pop(name)

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    def report(self) -> dict[str, float]:
        report, self.totals = {k: round(v * 1000, 2) for k, v in self.totals.items()}, {}
        return report


def scalars(record: dict):
    """(split/key, number) for every number in ``record`` but the step; lists (an MoE layer's per-expert token
    shares, one list per layer) become one scalar per entry: split/key/layer/expert."""
    def flatten(tag, value):
        if isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                yield from flatten(f"{tag}/{index}", item)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield tag, value
    prefix = record.get("split", "train")
    for key, value in record.items():
        if key not in ("step", "split"):
            yield from flatten(f"{prefix}/{key}", value)


class MetricsWriter:
    """JSONL always; TensorBoard and wandb when asked. Their packages are imported only then, so a run
    without them never pays for (or needs) them. ``wandb``: (project, mode, run config as a dict)."""

    def __init__(self, log_dir: str, enabled: bool, tensorboard: bool, wandb: tuple | None = None):
        self.enabled, self.log_dir = enabled, log_dir
        self._jsonl, self._tensorboard, self._wandb = None, None, None
        if not enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        self._jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tensorboard = SummaryWriter(os.path.join(log_dir, "tensorboard"))
        if wandb is not None:
            self._wandb = _start_wandb(log_dir, *wandb)

    @property
    def jsonl_path(self) -> str:
        return os.path.join(self.log_dir, "metrics.jsonl")

    def write(self, record: dict, console: str | None = None) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tensorboard is not None:
            for tag, value in scalars(record):
                self._tensorboard.add_scalar(tag, value, record["step"])
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(dict(scalars(record)), step=record["step"])
        if console:
            print(console, flush=True)

    def write_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        """Greedy continuations (prompt, text) at ``step``: one JSONL record and console line each, TensorBoard
        text (``samples/<i>``) and one wandb table."""
        if not self.enabled:
            return
        for index, (prompt, text) in enumerate(samples):
            self._jsonl.write(json.dumps({"step": step, "split": "sample", "prompt": prompt, "text": text}) + "\n")
            if self._tensorboard is not None:
                self._tensorboard.add_text(f"samples/{index}", f"**{prompt}**{text}", step)
            print(f"sample at step {step} | {prompt!r} -> {text!r}", flush=True)
        self._jsonl.flush()
        if self._tensorboard is not None:
            self._tensorboard.flush()
        if self._wandb is not None:
            import wandb  # imported already: the run was started with it
            self._wandb.log({"samples": wandb.Table(columns=["step", "prompt", "text"],
                                                    data=[[step, prompt, text] for prompt, text in samples])},
                            step=step)

    def resume_at(self, step: int) -> None:
        """Training resumes after ``step``: records of later steps in metrics.jsonl were written by an attempt that
        died before its next checkpoint and will be written again, so they move to metrics.superseded.jsonl (kept,
        in order, with a line the crash cut short) and the plot and any reader see each step once. The file is
        replaced atomically."""
        if not self.enabled:
            return
        self._jsonl.close()
        kept, superseded = [], []
        with open(self.jsonl_path, encoding="utf-8") as lines:
            for line in lines:
                try:
                    later = json.loads(line).get("step", 0) > step
                except (ValueError, AttributeError, TypeError):  # not a whole record
                    later, line = True, line.rstrip("\n") + "\n"
                (superseded if later else kept).append(line)
        if superseded:
            with open(os.path.join(self.log_dir, "metrics.superseded.jsonl"), "a", encoding="utf-8") as aside:
                aside.writelines(superseded)
            with open(self.jsonl_path + ".tmp", "w", encoding="utf-8") as rewritten:
                rewritten.writelines(kept)
            os.replace(self.jsonl_path + ".tmp", self.jsonl_path)
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(log_dir: str, project: str, mode: str, run_config: dict):
    """One wandb run per training run, named after log.dir; offline mode writes under log.dir/wandb and
    needs no network (upload later with `wandb sync`)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("log.wandb_project", project, "needs the wandb package, which is not installed",
                          "pip install wandb, or set log.wandb_project=null") from None
    return wandb.init(project=project, mode=mode, dir=log_dir, name=os.path.basename(os.path.normpath(log_dir)),
                      config=run_config)


def format_train_line(r: dict, total_steps: int) -> str:
    parts = [f"step {r['step']}/{total_steps}", f"loss {r['loss']:.4f}"]
    if "mtp_loss" in r:
        parts.append(f"mtp loss {r['mtp_loss']:.4f}")
    parts.append(f"lr {r['lr']:.3e}")
    if r.get("grad_norm") is not None:
        parts.append(f"grad norm {r['grad_norm']:.3f}")
    parts.append(f"skipped {r['skipped_steps']}")
    if "loss_scale" in r:
        parts.append(f"loss scale {r['loss_scale']:.0f}")
    parts += [f"{r['tokens_per_s']:.0f} tok/s", f"{r['tflops_per_device']:.2f} TFLOP/s/dev"]
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if "moe_aux_loss" in r:
        parts.append(format_moe(r))
    parts += [f"mem {r['mem_gib']:.2f}/{r['mem_peak_gib']:.2f} GiB", f"ETA {_duration(r['eta_s'])}"]
    if r.get("timers_ms"):
        parts.append("timers(ms) " + " ".join(f"{k} {v:.1f}" for k, v in r["timers_ms"].items()))
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
