"""The host-sync detector: what in a steady-state step would make the host wait for the GPU.

On a GPU the host queues kernels ahead of the device; anything that needs a device value on the host,
or copies between host and device synchronously, drains that queue and serialises compute with
communication. On fake devices nothing runs, so the detector looks at the operations themselves:
- a host read of a device value: ``.item()``, ``bool()``, ``int()``, ``float()``;
- a synchronising copy: host to device unless ``non_blocking`` from page-locked, dense memory (from
  pageable or strided memory CUDA stages through a pageable copy and blocks), device to host unless
  ``non_blocking`` (``.tolist()``, a copy to the host);
- a data-dependent shape (``nonzero``, ``bincount``, boolean indexing): the output size is a device value;
- a device ``synchronize``, ``Stream.synchronize``, an event waited for on the host in the step that
  recorded it (``runtime.py`` reports those).
Each finding names the library's file, line and function that asked for it (the innermost frame outside
torch and this package). Some are by design and listed in docs/design/nccl-rules.md ("No host syncs in a
steady-state step"); ``BY_DESIGN`` is that list, by the function that reads. Outside steady-state steps
(start-up, the first step, steps that log) nothing is recorded.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .shadows import is_fake

aten = torch.ops.aten
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # megatron_domino/
_SKIPPED = (os.path.dirname(os.path.abspath(torch.__file__)), os.path.dirname(os.path.abspath(__file__)))
# (file under megatron_domino/, function) -> why it reads the host on every step
BY_DESIGN = {
    ("optim/loss_scaler.py", "found_inf_across_ranks"): "fp16: an overflowed step is skipped on the host",
    ("optim/distributed_optimizer.py", "_found_inf"): "fp16: an overflowed step is skipped on the host",
    ("models/expert_dispatch.py", "__init__"): "MoE: the token count per expert sizes each expert's GEMM "
                                               "(and under EP the all-to-all)",
    ("training/guard.py", "_accept"): "the bad-step guard reads the loss and the grad norm",
    ("training/guard.py", "_first_rank"): "the bad-step guard names the rank of a non-finite gradient",
    ("optim/host_step.py", "_step_bucket"): "CPU offload: the host thread waits for the gradients it steps",
    ("pipeline/p2p.py", "_exchange_shapes"): "parallel.variable_seq_lengths: a pipeline receive reads its "
                                             "tensor's shape",
}


@dataclass
class HostSync:
    what: str
    where: str  # file:line (function)
    by_design: str | None  # the reason, when BY_DESIGN lists it
    reads: int = 1  # values read at once (a fake tensor's .tolist() reads its elements one by one)

    def __str__(self) -> str:
        reads = f" ({self.reads} values at once)" if self.reads > 1 else ""
        return f"{self.what}{reads} at {self.where}" + (f" (by design: {self.by_design})" if self.by_design else "")


class HostSyncError(RuntimeError):
    pass


def _caller() -> tuple[str, str | None]:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back
    if frame is None:
        return "<unknown>", None
    path, function = frame.f_code.co_filename, frame.f_code.co_name
    relative = os.path.relpath(path, _PACKAGE) if path.startswith(_PACKAGE) else path
    reason = BY_DESIGN.get((relative.replace(os.sep, "/"), function))
    return f"{relative}:{frame.f_lineno} ({function})", reason


def dense(tensor: torch.Tensor) -> bool:
    """Whether the elements fill their memory without gaps or repeats (any dimension order): what a copy
    needs to go straight from page-locked memory."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def pinned(tensor: torch.Tensor) -> bool:
    if is_fake(tensor):
        return bool(getattr(tensor, "_pinned", False))
    with _disable_current_modes():
        return tensor.is_pinned()


class HostSyncDetector:
    """Collects the host syncs of steady-state steps (``steady``); ``strict`` raises at the first one not
    by design, naming it."""

    def __init__(self, strict: bool = False):
        self.strict, self.steady = strict, False
        self.found: list[HostSync] = []
        self._ops = self._last_at = 0  # ops checked, and the count when the last sync was found

    def host_sync(self, what: str) -> None:
        if not self.steady:
            return
        where, reason = _caller()
        previous = self.found[-1] if self.found else None
        if previous and (previous.what, previous.where) == (what, where) and self._ops == self._last_at + 1:
            previous.reads += 1  # the next element of the same read, nothing done in between: one sync
            self._last_at = self._ops
            return
        self._last_at = self._ops
        sync = HostSync(what, where, reason)
        self.found.append(sync)
        if self.strict and reason is None:
            raise HostSyncError(f"host sync in a steady-state step: {sync}")

    @property
    def unexplained(self) -> list[HostSync]:
        return [s for s in self.found if s.by_design is None]

    def check(self, func, args, kwargs) -> None:
        """Before ``func`` runs: does it make the host wait?"""
        self._ops += 1
        if func is aten._local_scalar_dense.default and args[0].device.type == "cuda":
            self.host_sync("a host read of a device value (.item(), bool(), int())")
        elif func is aten._to_copy.default and "device" in kwargs:
            self._copy(args[0], torch.device(kwargs["device"]), None, kwargs.get("non_blocking", False))
        elif func is aten.copy_.default:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            self._copy(args[1], args[0].device, args[0], non_blocking)

    def _copy(self, source: torch.Tensor, target, destination, non_blocking: bool) -> None:
        if source.device.type == "cpu" and target.type == "cuda":
            if not non_blocking:
                self.host_sync("a blocking host-to-device copy (no non_blocking=True)")
            elif not pinned(source):
                self.host_sync("a host-to-device copy from pageable memory (pin it first)")
            elif not dense(source):
                self.host_sync("a host-to-device copy from strided host memory (stages through pageable memory)")
        elif source.device.type == "cuda" and target.type == "cpu":
            if not non_blocking or (destination is not None and not pinned(destination)):
                self.host_sync("a blocking device-to-host copy (.tolist(), a copy to the host)")

    def data_dependent(self, func) -> None:
        self.host_sync(f"a data-dependent shape ({func})")
