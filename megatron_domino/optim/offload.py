"""CPU offload of the optimizer (``optimizer.offload: cpu``): the fp32 masters and Adam's moments of this rank's
shard, or of a fraction of it (``optimizer.offload_fraction``, Megatron's name), live in host memory and are
updated there; DeepSpeed's ``offload_optimizer: {device: cpu}``.

One step, for the offloaded fragments:
  1. each reduced gradient (fp32, on the device) is copied into a page-locked host buffer without blocking;
  2. the host waits for those copies alone (an event recorded after them): the one host sync that offload adds
     to a step, listed in the README's host syncs;
  3. the inner optimizer updates the host masters with torch's multi-tensor CPU kernels;
  4. each updated master goes back into its weight, from page-locked memory, without blocking the host.
Device memory per weight is then the weight and its gradient (or gradient shard); the 12 bytes of master and
moments move to the host. Which fragments: the first ``offload_fraction`` of this rank's shard elements in
bucket order (the last layers', whose gradients are reduced first).
"""
from __future__ import annotations

import torch

from ..parallel.device import cuda, to_device


class HostOffload:
    """The offloaded fragments of one optimizer (by index into its fragment list) and their host buffers."""

    def __init__(self, fragments: list, fraction: float, device: torch.device):
        self.device, self.pinned = device, device.type == "cuda"
        sizes = [f.end - f.start for f in fragments]
        budget, taken, chosen = fraction * sum(sizes), 0, []
        for index, size in enumerate(sizes):
            if taken >= budget:
                break
            chosen.append(index)
            taken += size
        self.host_grads = {i: torch.empty(sizes[i], dtype=torch.float32, pin_memory=self.pinned) for i in chosen}

    @property
    def chosen(self):
        """Indices of the offloaded fragments."""
        return self.host_grads.keys()

    def master(self, fragment) -> torch.Tensor:
        """The host master of an offloaded fragment: a copy of its weight."""
        master = torch.empty(fragment.data.numel(), dtype=torch.float32, pin_memory=self.pinned)
        master.copy_(fragment.data)
        return master

    def gradients_to_host(self, fragments: list, masters: list) -> None:
        """Give each host master its gradient: copied from the device, waited for by the host (steps 1-2)."""
        for index, host_grad in self.host_grads.items():
            host_grad.copy_(fragments[index].grad, non_blocking=True)
            masters[index].grad = host_grad
        if self.pinned and self.host_grads:
            copied = cuda.Event()
            copied.record()
            copied.synchronize()

    def weights_to_device(self, fragments: list, masters: list) -> None:
        """Each updated host master back into its weight (step 4), cast on the device."""
        for index in self.host_grads:
            fragments[index].data.copy_(to_device(masters[index], self.device))

    def host_bytes(self, masters: list, states: dict) -> int:
        """Masters and optimizer state held in host memory."""
        held = [masters[i] for i in self.chosen]
        held += [t for i in self.chosen for t in states.get(masters[i], {}).values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in held)
