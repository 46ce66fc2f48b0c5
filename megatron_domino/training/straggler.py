"""The straggler report (log.straggler_interval): which ranks compute slowest, by coordinate, against the median.

A rank's compute time over one forward-backward is, on the CPU, the CPU time of its main thread
(``time.thread_time``): a rank blocked in a pipeline receive, a TP or DP all-reduce or the loss's
all-reduce uses no CPU, so every wait for a slow peer drops out, and so does time the OS gave to other
ranks sharing the cores. (Wall time minus p2p receive waits is not enough: the loss all-reduce at the end
of every forward-backward makes each rank wait as long as the slowest.) On CUDA it is the wall time of a
forward-backward bracketed by device synchronisations, which still includes waits in collectives: a
per-kernel measure (CUDA events around compute only) is not done yet.

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

SLOWEST_SHOWN = 3


class StragglerReport:
    def __init__(self, state, interval: int, device: torch.device, log_dir: str):
        self.state, self.interval, self.device, self.log_dir = state, interval, device, log_dir
        self._start: float | None = None

    def measures(self, step: int) -> bool:
        return step % self.interval == 0

    def start(self, step: int) -> None:
        """Before ``step``'s forward-backward (a no-op on steps that do not report)."""
        if self.measures(step):
            self._start = self._clock()

    def finish(self, step: int) -> None:
        """After ``step``'s forward-backward: gather every rank's compute time and report on rank 0."""
        if self._start is None:
            return
        mine = torch.tensor([self._clock() - self._start], dtype=torch.float64, device=self.device)
        self._start = None
        gathered = torch.empty(self.state.topology.world_size, dtype=torch.float64, device=self.device)
        dist.all_gather_into_tensor(gathered, mine)
        if self.state.rank == 0:
            self._report(step, gathered.tolist())

    def _clock(self) -> float:
        if self.device.type != "cuda":
            return time.thread_time()
        torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _report(self, step: int, seconds: list[float]) -> None:
        median = statistics.median(seconds)
        slowest = sorted(range(len(seconds)), key=lambda r: -seconds[r])[:SLOWEST_SHOWN]
        rows = []
        for rank in slowest:
            c = self.state.topology.coordinate(rank)
            rows.append({"rank": rank, "tp": c.tp, "pp": c.pp, "dp": c.dp, "compute_ms": 1000 * seconds[rank],
                         "ratio_to_median": seconds[rank] / median if median > 0 else float("inf")})
        print(f"stragglers at step {step}: median compute {1000 * median:.1f} ms; slowest " + ", ".join(
            f"rank {r['rank']} (tp {r['tp']}, pp {r['pp']}, dp {r['dp']}) {r['compute_ms']:.1f} ms "
            f"x{r['ratio_to_median']:.2f}" for r in rows), flush=True)
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, "stragglers.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "median_compute_ms": 1000 * median, "slowest": rows}) + "\n")
