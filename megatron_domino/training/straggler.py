"""The straggler report (log.straggler_interval): which ranks compute slowest, by coordinate, against the median.

A rank's compute time over one forward-backward is, on the CPU, the CPU time of its main thread
(``time.thread_time``): a rank blocked in a pipeline receive, a TP or DP all-reduce or the loss's
all-reduce uses no CPU, so every wait for a slow peer drops out, and so does time the OS gave to other
ranks sharing the cores. (Wall time minus p2p receive waits is not enough: the loss all-reduce at the end
of every forward-backward makes each rank wait as long as the slowest.) On CUDA the host only queues work,
so its clock says nothing; the forward-backward runs under ``torch.profiler`` (CUDA activity only) and the
measure is the summed duration of its kernels that are not NCCL's. A rank stalled in a collective waits in
an NCCL kernel or in a stream wait, neither of which counts. When another profiler is already recording
(``log.profile_steps``), that step falls back to wall time between device synchronisations.

Only report steps are measured, so other steps keep their overlap and read nothing on the host. Every
rank all-gathers one number; rank 0 prints the slowest ranks and appends them to ``<log.dir>/stragglers.jsonl``.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ..parallel.device import cuda

SLOWEST_SHOWN = 3


class StragglerReport:
    def __init__(self, state, interval: int, device: torch.device, log_dir: str):
        self.state, self.interval, self.device, self.log_dir = state, interval, device, log_dir
        self._start: float | None = None
        self._kernels: profile | None = None

    def measures(self, step: int) -> bool:
        return step % self.interval == 0

    def start(self, step: int) -> None:
        """Before ``step``'s forward-backward (a no-op on steps that do not report)."""
        if not self.measures(step):
            return
        if self.device.type == "cuda" and not torch.autograd._profiler_enabled():
            cuda.synchronize(self.device)
            self._kernels = profile(activities=[ProfilerActivity.CUDA])
            self._kernels.__enter__()
        self._start = self._clock()

    def finish(self, step: int) -> None:
        """After ``step``'s forward-backward: gather every rank's compute time and report on rank 0."""
        if self._start is None:
            return
        seconds = self._clock() - self._start
        if self._kernels is not None:
            self._kernels.__exit__(None, None, None)
            seconds = compute_kernel_seconds(self._kernels.events())
        self._start, self._kernels = None, None
        mine = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        gathered = torch.empty(self.state.topology.world_size, dtype=torch.float64, device=self.device)
        dist.all_gather_into_tensor(gathered, mine)
        if self.state.rank == 0:
            self._report(step, gathered.tolist())

    def _clock(self) -> float:
        if self.device.type != "cuda":
            return time.thread_time()
        cuda.synchronize(self.device)
        return time.perf_counter()

    def _report(self, step: int, seconds: list[float]) -> None:
        median = statistics.median(seconds)
        slowest = sorted(range(len(seconds)), key=lambda r: -seconds[r])[:SLOWEST_SHOWN]
        rows = []
        for rank in slowest:
            c = self.state.topology.coordinate(rank)
            rows.append({"rank": rank, "tp": c.tp, "cp": c.cp, "pp": c.pp, "dp": c.dp,
                         "compute_ms": 1000 * seconds[rank],
                         "ratio_to_median": seconds[rank] / median if median > 0 else float("inf")})
        axes = ("tp", "cp", "pp", "dp") if self.state.topology.cp > 1 else ("tp", "pp", "dp")
        print(f"stragglers at step {step}: median compute {1000 * median:.1f} ms; slowest " + ", ".join(
            f"rank {r['rank']} ({', '.join(f'{a} {r[a]}' for a in axes)}) {r['compute_ms']:.1f} ms "
            f"x{r['ratio_to_median']:.2f}" for r in rows), flush=True)
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, "stragglers.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "median_compute_ms": 1000 * median, "slowest": rows}) + "\n")


def compute_kernel_seconds(events) -> float:
    """Summed duration of the GPU kernels in a profile that are not NCCL's (collectives and p2p)."""
    return sum(event.time_range.elapsed_us() for event in events
               if event.device_type == DeviceType.CUDA and not event.name.lower().startswith("nccl")) / 1e6
