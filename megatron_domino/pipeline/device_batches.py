"""A step's micro-batches on the device one at a time, the next one's copy started while the current computes.

Copying every micro-batch of a step to the device at once holds all of them there for the whole step:
with long sequences and document masks that is most of a step's input memory for nothing. Here micro-batch
i is copied when the schedule first reads it, and i + 1 is copied right after, on a side stream on CUDA,
so the copy overlaps the compute of i: the compute stream waits for the event recorded after i's copy,
never for the side stream as a whole (which would include i + 1's copy, queued after). At most ``keep``
micro-batches stay on the device (an interleaved schedule that comes back to an evicted one copies it
again). On the CPU the "copy" is the tensor itself.

``doc_offsets`` (``HOST_KEYS``) stay in host memory: document attention reads their values on the host to slice
each document out of q/k/v, every layer. From a device copy each of those reads would stall the host
until the device caught up (a sync per layer and micro-batch); they are a few integers per sample anyway.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from ..parallel.device import cuda, to_device

# batch entries the host reads: never copied to the device
HOST_KEYS = frozenset({"doc_offsets"})


class DeviceBatches(Sequence):
    def __init__(self, host: list[dict], device: torch.device, keep: int = 2):
        self.host, self.device, self.keep = host, device, keep
        self._on_device: OrderedDict[int, tuple[dict, object]] = OrderedDict()  # index -> (batch, its copy's event)
        self._stream = cuda.Stream(device) if device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self.host)

    def __getitem__(self, index: int) -> dict:
        batch, copied = self._fetch(index)
        if copied is not None:  # order the compute after this batch's copy only, not after the prefetch below
            current = cuda.current_stream(self.device)
            current.wait_event(copied)
            for key, tensor in batch.items():
                if key not in HOST_KEYS:
                    cuda.record_stream(tensor, current)
        if index + 1 < len(self.host):
            self._fetch(index + 1)
        return batch

    def _fetch(self, index: int) -> tuple[dict, object]:
        if index in self._on_device:
            self._on_device.move_to_end(index)
            return self._on_device[index]
        with cuda.stream(self._stream):
            batch = {k: v if k in HOST_KEYS else to_device(v, self.device) for k, v in self.host[index].items()}
            copied = self._stream.record_event() if self._stream is not None else None
        self._on_device[index] = batch, copied
        while len(self._on_device) > self.keep:
            self._on_device.popitem(last=False)
        return batch, copied
