"""Stand-ins for the CUDA runtime calls the library makes (``parallel.device``), for fake devices.

Each stand-in does what the real call means for a program that cannot run kernels: streams and events
order nothing (no kernel runs) but are objects with the real methods; a call that would block the host
until the device catches up (``synchronize``, an event recorded in this step and waited for on the host)
is reported to the host-sync detector; RNG states are the 16 bytes (seed, offset) a CUDA generator keeps;
memory statistics come from the rehearsal's allocation accounting; the device name and capability are the
GPU being rehearsed. The current device is the fake guard's, per thread, as in CUDA: a thread starts on
device 0 until it sets one.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from ..parallel.device import CudaRuntime


class FakeEvent:
    def __init__(self, runtime: "RehearsalRuntime"):
        self._runtime, self.recorded_at = runtime, None

    def record(self, stream=None) -> None:
        self.recorded_at = self._runtime.step

    def wait(self, stream=None) -> None:
        pass  # a stream waits: no host stall

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """The host waits for the event: a stall when it was recorded in this very step."""
        if self.recorded_at == self._runtime.step:
            self._runtime.syncs.host_sync("Event.synchronize on an event recorded in the same step")

    def elapsed_time(self, other: "FakeEvent") -> float:
        return 0.0


class FakeStream:
    def __init__(self, runtime: "RehearsalRuntime", device: torch.device, name: str):
        self._runtime, self.device, self.name = runtime, device, name

    def wait_stream(self, other: "FakeStream") -> None:
        pass

    def wait_event(self, event: FakeEvent) -> None:
        pass

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent(self._runtime)
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self._runtime.syncs.host_sync("Stream.synchronize")

    def __repr__(self) -> str:
        return f"<fake {self.name} stream on {self.device}>"


class RehearsalRuntime(CudaRuntime):
    """``CudaRuntime`` for fake devices: ``library`` is the loaded fake CUDA library (``fake_cuda.load()``),
    ``syncs`` the host-sync detector, ``memory`` the allocation accounting."""

    def __init__(self, library, syncs, memory, gpu_name: str, capability: tuple[int, int]):
        self.library, self.syncs, self.memory = library, syncs, memory
        self.gpu_name, self.capability = gpu_name, capability
        self.step = 0  # the rehearsal's step counter: events remember when they were recorded
        self._rng: dict[int, torch.Tensor] = {}
        self._current = threading.local()  # the current stream per thread and device
        self._default: dict[int, FakeStream] = {}

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.library.fake_cuda_device_count()

    def set_device(self, index: int) -> None:
        self.library.fake_cuda_set_device(int(index))

    def current_device(self) -> int:
        return self.library.fake_cuda_current_device()

    def synchronize(self, device=None) -> None:
        self.syncs.host_sync("a device synchronize (cuda.synchronize)")

    def _index(self, device) -> int:
        if device is None:
            return self.current_device()
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        return device.index if device.index is not None else self.current_device()

    def Stream(self, device=None):  # noqa: N802
        return FakeStream(self, torch.device("cuda", self._index(device)), "side")

    def current_stream(self, device=None):
        index = self._index(device)
        current = getattr(self._current, "streams", {}).get(index)
        if current is None:
            current = self._default.setdefault(index, FakeStream(self, torch.device("cuda", index), "default"))
        return current

    @contextlib.contextmanager
    def stream(self, stream):
        if stream is None:
            yield
            return
        streams = self._current.__dict__.setdefault("streams", {})
        index = stream.device.index
        previous = streams.get(index)
        streams[index] = stream
        try:
            yield
        finally:
            streams[index] = previous

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        pass  # no caching allocator to tell

    def Event(self, enable_timing: bool = False):  # noqa: N802
        return FakeEvent(self)

    def get_rng_state(self, device) -> torch.Tensor:
        return self._rng.get(self._index(device), torch.zeros(16, dtype=torch.uint8)).clone()

    def set_rng_state(self, state: torch.Tensor, device) -> None:
        self._rng[self._index(device)] = state.clone()

    def manual_seed(self, seed: int) -> None:
        state = torch.zeros(16, dtype=torch.uint8)
        state[:8] = torch.tensor([seed % 2**63], dtype=torch.int64).view(torch.uint8)
        self._rng[self.current_device()] = state

    def memory_allocated(self, device) -> int:
        return self.memory.live_bytes

    def max_memory_allocated(self, device) -> int:
        return self.memory.peak_bytes

    def get_device_name(self, device) -> str:
        return self.gpu_name

    def get_device_capability(self, device) -> tuple[int, int]:
        return self.capability

    def set_sync_debug_mode(self, mode: str) -> None:
        pass  # the rehearsal decides which steps are steady (host_syncs.HostSyncDetector.steady)

    def record_memory_history(self, max_entries: int | None) -> None:
        pass

    def dump_memory_snapshot(self, path: str) -> None:
        pass
