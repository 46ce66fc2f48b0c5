"""Device memory of a rehearsal: every fake ``cuda`` storage, from its allocation to its release, by category.

A fake tensor allocates nothing, but its storage has the real size and lives exactly as long as the real
one would, so the sum over live storages is what the caching allocator would be asked for (without its
rounding to 512-byte blocks and without fragmentation). Storages are counted once however many views
share them. A storage's category is decided where its role becomes known:
- ``parameters``, ``gradients``, ``optimizer``: the model's weights, the gradient buffers and shards, the
  fp32 masters and Adam moments (``claim`` after the trainer is built and after the first step);
- ``activations``: what autograd saves for backward (``saved_tensors_hooks``);
- ``communication``: buffers a collective or a pipeline receive writes into, unless later saved;
- ``other``: everything else (temporaries, outputs the pipeline holds, the loss, CUDA RNG states).
"""
from __future__ import annotations

import weakref

import torch

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "communication", "other")
# a later role wins over an earlier one only in this order (a received buffer that is saved is an activation)
_UPGRADES = {"other": ("communication", "activations"), "communication": ("activations",)}


class AllocationAccounting:
    def __init__(self, device_type: str = "cuda"):
        self.device_type = device_type  # the storages counted: the fake devices', or the host's in a timed run
        self._live: dict[int, list] = {}  # storage address -> [bytes, category]
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.live_bytes = self.peak_bytes = 0
        self.peak_by_category = dict(self.by_category)

    def track(self, tensors) -> None:
        """Count the storages of ``tensors`` (fake cuda tensors; others are ignored) not yet counted."""
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != self.device_type:
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self._live:
                continue
            size = storage.nbytes()
            self._live[key] = [size, "other"]
            weakref.finalize(storage, self._free, key)
            self.by_category["other"] += size
            self.live_bytes += size
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes, self.peak_by_category = self.live_bytes, dict(self.by_category)

    def _free(self, key: int) -> None:
        size, category = self._live.pop(key)
        self.by_category[category] -= size
        self.live_bytes -= size

    def claim(self, tensors, category: str, force: bool = False) -> None:
        """Mark the storages of ``tensors`` as ``category``: always with ``force`` (ownership known from the
        trainer's objects), otherwise only where it upgrades the role (``_UPGRADES``)."""
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != self.device_type:
                continue
            entry = self._live.get(tensor.untyped_storage()._cdata)
            if entry is None or entry[1] == category:
                continue
            if force or category in _UPGRADES.get(entry[1], ()):
                self.by_category[entry[1]] -= entry[0]
                self.by_category[category] += entry[0]
                entry[1] = category

    def saved_for_backward(self, tensor: torch.Tensor) -> torch.Tensor:
        """``saved_tensors_hooks`` pack hook: the tensor is an activation, kept as a detached alias (the same
        storage; see ``optim.weight_units.WeightUnits.pack`` for the cycle the tensor itself would make)."""
        self.claim([tensor], "activations")
        return tensor.detach()

    def resized(self, tensor: torch.Tensor, category: str) -> None:
        """``tensor``'s storage was resized in place (ZeRO-3 allocates and frees a layer's gathered weights this
        way, ``optim.weight_store``): count its new size, as ``category``."""
        self.track([tensor])
        entry = self._live.get(tensor.untyped_storage()._cdata)
        if entry is None:
            return
        size = tensor.untyped_storage().nbytes()
        self.by_category[entry[1]] -= entry[0]
        self.live_bytes += size - entry[0]
        entry[:] = [size, category]
        self.by_category[category] += size
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_by_category = self.live_bytes, dict(self.by_category)

    def reset_peak(self) -> None:
        self.peak_bytes, self.peak_by_category = self.live_bytes, dict(self.by_category)
