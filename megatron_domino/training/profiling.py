"""The profiler window (log.profile_steps = [start, end]): a torch.profiler trace per rank over those steps.

Only the window pays for profiling; outside it the named ranges (``record_function`` in the pipeline
and Domino executors, the optimizer step and data loading) cost a check each. The trace is Chrome /
Perfetto JSON, ``<log.dir>/profile/trace-rank<R>.json``, with CPU activity and, on CUDA, kernels too.
On CUDA, log.profile_memory also records the allocator's history over the window and dumps a snapshot
(``memory-rank<R>.pickle``, for https://pytorch.org/memory_viz).
"""
from __future__ import annotations

import os

import torch
from torch.profiler import ProfilerActivity, profile


class ProfileWindow:
    def __init__(self, steps: list[int], log_dir: str, rank: int, device: torch.device, memory: bool):
        self.start, self.end = steps
        self.folder, self.rank = os.path.join(log_dir, "profile"), rank
        self.cuda = device.type == "cuda"
        self.memory = memory and self.cuda
        self._profiler = None

    def before_step(self, step: int) -> None:
        """``step``: the number of the step about to run (1-based, as logged)."""
        if step != self.start:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)

    def after_step(self, step: int) -> None:
        if step >= self.end:
            self.close()

    def close(self) -> None:
        """Ends the window and writes its files (also when the run stops inside the window)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        os.makedirs(self.folder, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(self.folder, f"trace-rank{self.rank}.json"))
        if self.memory:
            torch.cuda.memory._dump_snapshot(os.path.join(self.folder, f"memory-rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
