"""The GPU work that stands in for one NCCL operation: hold SMs for the modelled time, as NCCL's kernels do.

NCCL runs a collective as one kernel of one thread block per channel, each block busy moving data for the
whole transfer, so communication takes SMs from the compute it overlaps. ``LinkKernel`` does the same with two
kernels compiled at first use by NVRTC (torch's ``_compile_kernel``): ``stamp`` writes the GPU's global
nanosecond timer into a slot as the operation starts on its stream; the operation's values are then written by
ordinary kernels (the message's memory traffic); and ``hold`` runs ``sms`` blocks that spin until the slot's
time plus the modelled duration, so the operation ends ``seconds`` after it started, not after its copies plus
``seconds``. Slots are a ring of 4,096 per stream: a stream runs its operations in order, so a slot is reused
only long after its operation ended.

Without NVRTC (a torch build without it) the fallback is torch's ``_sleep`` kernel on one SM, for a number of
clock cycles calibrated once against CUDA events; the start stamp is then lost, so the copies add to the
modelled time. ``LinkKernel.kind`` says which runs (the timed rehearsal reports it). Both reach the CUDA runtime
through ``parallel.device``, the one door.
"""
from __future__ import annotations

import torch

from ..parallel.device import cuda

_SOURCE = r"""
extern "C" __global__ void link_stamp(unsigned long long* slot) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    *slot = now;
}

extern "C" __global__ void link_hold(const unsigned long long* slot, double seconds) {
    unsigned long long until = *((volatile const unsigned long long*) slot) + (unsigned long long) (seconds * 1e9);
    unsigned long long now;
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now < until);
}
"""
SLOTS = 4096
THREADS = 128  # per block: a warp scheduler's share of an SM kept busy, as NCCL's copy loops keep it


class LinkKernel:
    """``stamp(stream)`` -> a start handle; ``hold(stream, start, seconds, sms)``; both on the current device."""

    def __init__(self, device: torch.device):
        self.device = device
        self._slots: dict = {}  # stream -> (slot tensor, next index)
        try:
            self._stamp = cuda.compile_kernel(_SOURCE, "link_stamp")
            self._hold = cuda.compile_kernel(_SOURCE, "link_hold")
            self.kind = "nvrtc"
        except Exception as error:  # noqa: BLE001 - any failure to compile means: use the fallback
            self._stamp = self._hold = None
            self.kind = f"torch's sleep kernel on one SM (NVRTC: {type(error).__name__}: {error})"
            self._cycles_per_second = _calibrate(device)

    def stamp(self, stream):
        if self._stamp is None:
            return None
        slots, index = self._slots.get(stream, (None, 0))
        if slots is None:
            slots = torch.zeros(SLOTS, dtype=torch.int64, device=self.device)
        self._slots[stream] = (slots, (index + 1) % SLOTS)
        slot = slots[index:index + 1]
        self._stamp(grid=(1, 1, 1), block=(1, 1, 1), args=[slot], stream=stream)
        return slot

    def hold(self, stream, start, seconds: float, sms: int) -> None:
        if seconds <= 0:
            return
        if self._hold is None:
            cuda.sleep(max(1, int(seconds * self._cycles_per_second)))
            return
        self._hold(grid=(max(1, sms), 1, 1), block=(THREADS, 1, 1), args=[start, float(seconds)], stream=stream)


def _calibrate(device: torch.device) -> float:
    """Clock cycles per second of torch's sleep kernel on ``device``: one timed 20M-cycle sleep (once)."""
    begin, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    begin.record()
    cuda.sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / (begin.elapsed_time(end) / 1e3)
