"""A fused CUDA kernel that FP8 uses only where it runs and agrees with an emulation.

Whether a kernel exists depends on the torch build, the CUDA version and the GPU, and a kernel that misreads a
scale's layout is silently wrong. So each is tried once per device, on known numbers, before its first use (in
step 1: the verdict is read on the host); where it fails, the caller's slower path runs, with one warning. A
verdict is False or what works (True, or which of several ways to call the kernel). ``assumed`` sets the verdict
without trying: a rehearsal's fake tensors hold no numbers to try, and a test compares both paths on one GPU.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable

import torch

from ..parallel.device import cuda


class ProbedKernel:
    def __init__(self, probe: Callable[[torch.device], object], without_it: str):
        """``probe(device)``: does the kernel run there and agree (False, or what works)? ``without_it``: what
        runs instead, and why that matters (the warning's second half)."""
        self._probe, self._without_it = probe, without_it
        self._verdicts: dict[torch.device, object] = {}

    def works(self, device: torch.device) -> bool:
        return bool(self.verdict(device))

    def verdict(self, device: torch.device):
        if device.type != "cuda":
            return False
        if device not in self._verdicts:
            self._verdicts[device] = self._probe(device)
            if not self._verdicts[device]:
                warnings.warn(f"{cuda.get_device_name(device)} (torch {torch.__version__}): {self._without_it}",
                              stacklevel=3)
        return self._verdicts[device]

    @contextlib.contextmanager
    def assumed(self, verdict, devices: Iterable[torch.device]):
        """Within the block, the kernel is taken to work (or not) on ``devices`` without a probe."""
        saved = dict(self._verdicts)
        self._verdicts.update({device: verdict for device in devices})
        try:
            yield
        finally:
            self._verdicts.clear()
            self._verdicts.update(saved)
