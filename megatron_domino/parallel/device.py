"""The one door to the CUDA runtime: every stream, event, synchronize, RNG state, memory statistic and
device query the library makes goes through ``cuda`` here, never through ``torch.cuda`` directly.

Why a door: the CUDA paths must run before the first GPU run does. A rehearsal
(``megatron_domino.rehearsal``) plays a full-size job on fake ``cuda`` tensors on a CPU-only build,
where ``torch.cuda`` has nothing behind it; it installs stand-ins for these calls (``install``) and
nothing else in the library needs to know. ``cuda`` forwards every attribute to the runtime in use:
torch's own (``CudaRuntime``) unless a stand-in is installed. Its names are ``torch.cuda``'s, so a call
site reads as before (``cuda.synchronize(device)``), except where torch's name is a tensor method
(``record_stream``) or lives in a private submodule (the allocator history).
"""
from __future__ import annotations

import contextlib

import torch


class CudaRuntime:
    """``torch.cuda`` itself (the real device)."""

    OutOfMemoryError = torch.OutOfMemoryError

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def synchronize(self, device=None) -> None:
        torch.cuda.synchronize(device)

    def Stream(self, device=None):  # noqa: N802 - torch.cuda's name
        return torch.cuda.Stream(device)

    def current_stream(self, device=None):
        return torch.cuda.current_stream(device)

    def stream(self, stream):
        """Context manager making ``stream`` current (None: no change)."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Tell the allocator ``tensor`` is in use on ``stream`` too (torch's ``Tensor.record_stream``)."""
        tensor.record_stream(stream)

    def Event(self, enable_timing: bool = False):  # noqa: N802 - torch.cuda's name
        return torch.cuda.Event(enable_timing=enable_timing)

    def get_rng_state(self, device) -> torch.Tensor:
        return torch.cuda.get_rng_state(device)

    def set_rng_state(self, state: torch.Tensor, device) -> None:
        torch.cuda.set_rng_state(state, device)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def memory_allocated(self, device) -> int:
        return torch.cuda.memory_allocated(device)

    def max_memory_allocated(self, device) -> int:
        return torch.cuda.max_memory_allocated(device)

    def reset_peak_memory_stats(self, device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def mem_get_info(self, device) -> tuple[int, int]:
        """(free, total) bytes of ``device`` as the driver reports them."""
        return torch.cuda.mem_get_info(device)

    def get_device_name(self, device) -> str:
        return torch.cuda.get_device_name(device)

    def get_device_capability(self, device) -> tuple[int, int]:
        return torch.cuda.get_device_capability(device)

    def set_sync_debug_mode(self, mode: str) -> None:
        torch.cuda.set_sync_debug_mode(mode)

    def record_memory_history(self, max_entries: int | None) -> None:
        """Start (``max_entries``) or stop (None) recording the allocator's history."""
        if max_entries is None:
            torch.cuda.memory._record_memory_history(enabled=None)
        else:
            torch.cuda.memory._record_memory_history(max_entries=max_entries)

    def dump_memory_snapshot(self, path: str) -> None:
        torch.cuda.memory._dump_snapshot(path)

    def compile_kernel(self, source: str, name: str):
        """A raw kernel compiled by NVRTC, called as ``kernel(grid=, block=, args=, stream=)`` (torch >= 2.8)."""
        return torch.cuda._compile_kernel(source, name)

    def sleep(self, cycles: int) -> None:
        """Keep one SM of the current stream busy for ``cycles`` clock cycles (torch's test kernel)."""
        torch.cuda._sleep(cycles)


class _InUse:
    """``cuda``: forwards to the runtime in use, so a stand-in installed later is seen by every caller."""

    def __getattr__(self, name: str):
        return getattr(_runtime, name)


_runtime: CudaRuntime = CudaRuntime()
cuda = _InUse()


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-to-device copy that does not wait for the device: from dense page-locked memory (a copy from
    pageable or strided memory is staged through a pageable buffer and blocks the host until the stream's
    earlier work is done). torch's page-locked allocator keeps the source alive until the copy has run.
    On the CPU: the tensor itself."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.contiguous().pin_memory()
    return tensor.to(device, non_blocking=True)


def install(runtime: CudaRuntime) -> CudaRuntime:
    """Make ``runtime`` the one every ``cuda.*`` call reaches; returns the previous one (to reinstall)."""
    global _runtime
    previous, _runtime = _runtime, runtime
    return previous
