"""The profiler window (log.profile_steps = [start, end]): a torch.profiler trace per rank over those steps.

Only the window pays for profiling; outside it the named ranges (``record_function`` in the pipeline
and Domino executors, the optimizer step and data loading) cost a check each. The trace is Chrome /
Perfetto JSON, ``<log.dir>/profile/trace-rank<R>.json``, with CPU activity and, on CUDA, kernels too.
On CUDA, log.profile_memory also records the allocator's history over the window and dumps a snapshot
(``memory-rank<R>.pickle``, for https://pytorch.org/memory_viz). log.oom_snapshot records that history
from the start instead, and dumps it (``oom-rank<R>.pickle``) when a step runs out of device memory: what
held the memory at the moment it ran out.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

from ..parallel.device import cuda


class ProfileWindow:
    def __init__(self, steps: list[int], log_dir: str, rank: int, device: torch.device, memory: bool,
                 keep_history: bool = False):
        """``keep_history``: the allocator's history stays on after the window (an ``OomSnapshot`` needs it)."""
        self.start, self.end = steps
        self.folder, self.rank = os.path.join(log_dir, "profile"), rank
        self.cuda = device.type == "cuda"
        self.memory, self.keep_history = memory and self.cuda, keep_history
        self._profiler = None

    def before_step(self, step: int) -> None:
        """``step``: the number of the step about to run (1-based, as logged)."""
        if step != self.start:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()
        if self.memory:
            cuda.record_memory_history(1_000_000)

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
            cuda.dump_memory_snapshot(os.path.join(self.folder, f"memory-rank{self.rank}.pickle"))
            if not self.keep_history:
                cuda.record_memory_history(None)


class OomSnapshot:
    """log.oom_snapshot on CUDA: the allocator's history is recorded from the start (a small cost per
    allocation) and dumped when a step runs out of device memory; the error is raised as before."""

    def __init__(self, log_dir: str, rank: int, device: torch.device, enabled: bool):
        self.enabled = enabled and device.type == "cuda"
        self.path = os.path.join(log_dir, "profile", f"oom-rank{rank}.pickle")
        if self.enabled:
            cuda.record_memory_history(100_000)

    @contextmanager
    def watching(self):
        try:
            yield
        except cuda.OutOfMemoryError:
            if self.enabled:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                cuda.dump_memory_snapshot(self.path)
                print(f"out of device memory: the allocator's history is in {self.path} "
                      f"(open it at https://pytorch.org/memory_viz)", flush=True)
            raise
