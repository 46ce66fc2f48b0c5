"""CPU offload of the optimizer (``optimizer.offload: cpu``), stepped on a host thread behind the next forward.

What lives on the host: the masters and Adam's moments of whole buckets of this rank's shard, the first
``optimizer.offload_fraction`` of its elements in bucket order (the last layers', whose gradients are reduced
first). Megatron's ``optimizer_offload_fraction``, rounded up to whole buckets so that every rank of a bucket's
group offloads the same buckets and so issues the same collectives; DeepSpeed's ``offload_optimizer: {device:
cpu}``. Device memory per weight is then the weight and its gradient (or gradient shard).

One step of the offloaded buckets:
  1. main thread, after unscaling and clipping: each reduced gradient is copied into page-locked host memory
     without blocking, and an event is recorded behind the copies (no host sync on the main thread);
  2. host thread: waits for that event, then steps the buckets one by one, in the order the next forward reads
     them, with torch's multi-tensor CPU AdamW (or SGD; Muon's matrices take the update the device orthogonalized,
     whose momentum stays on the device beside the collectives that Newton-Schulz needs);
  3. main thread, at the first read of a bucket's weights in the next forward (``weight_hooks.watch_reads``;
     under ZeRO-3, its gather): waits for that bucket's host step, copies its masters into the weights from
     page-locked memory without blocking and, under ZeRO-1/2, all-gathers the bucket over its group.
So the host step runs behind the next step's data loading and forward: layer k is updated while layer k-1
computes. Buckets are completed strictly in that order, whichever read comes first, so every rank issues the
all-gathers in the same order. ``optimizer.overlap_offload_step: false`` completes them all at the end of the
step instead (nothing overlaps: for measurements and debugging).
"""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch

from ..parallel.device import cuda, to_device
from .low_precision import DTYPES
from .muon_math import DTYPES as NS_DTYPES
from .param_groups import InnerSteps
from .weight_hooks import watch_reads


def _whole_buckets(placed: list[tuple], fraction: float) -> list[tuple]:
    """The first (store, bucket) pairs in bucket order whose shards hold ``fraction`` of this rank's elements."""
    budget, taken, chosen = fraction * sum(bucket.shard_size for _, bucket in placed), 0, []
    for store, bucket in placed:
        if taken >= budget:
            break
        chosen.append((store, bucket))
        taken += bucket.shard_size
    return chosen


class HostStep:
    """The offloaded buckets of one optimizer: their masters (by index into its fragment list), host gradients,
    their own inner optimizer, and the thread that steps them. ``placed``: every (weight store, bucket) of the
    optimizer's buffers in bucket order; ``forward_rank``: id(parameter) -> its place in the forward order."""

    def __init__(self, placed: list[tuple], fragments: list, opt, forward_rank: dict[int, int],
                 device: torch.device, scales: dict[int, float | None], keys: list[tuple]):
        self.fragments, self.device, self.overlap = fragments, device, opt.overlap_offload_step
        chosen = _whole_buckets(placed, opt.offload_fraction if opt.offload else 0.0)
        self.order = sorted(chosen, key=lambda pair: min(forward_rank[id(p)] for p in pair[1].params))
        self.position = {id(bucket): k for k, (_, bucket) in enumerate(self.order)}
        self.members = {id(bucket): [i for i, f in enumerate(fragments) if f.bucket is bucket]
                        for _, bucket in self.order}
        pinned = device.type == "cuda"
        self.masters, self.grads = {}, {}  # Muon's fragments receive their orthogonalized update, not a gradient
        for indices in self.members.values():
            for i in indices:
                data = fragments[i].data
                self.masters[i] = torch.empty(data.numel(), dtype=DTYPES[opt.master_dtype], pin_memory=pinned)
                self.masters[i].copy_(data)
                arrives = NS_DTYPES[opt.muon_ns_dtype] if scales.get(i) is not None else torch.float32
                self.grads[i] = torch.empty(data.numel(), dtype=arrives, pin_memory=pinned)
        self.optimizer = (InnerSteps([(self.masters[i], fragments[i].param, scales.get(i), keys[i])
                                      for i in self.masters], opt) if self.masters else None)
        self.lr, self.number = opt.lr, 0
        self.jobs: list = []  # this step's host steps, one per bucket of ``order``
        self.done = len(self.order)  # buckets of ``order`` completed since the last launch
        self.late = 0  # buckets completed by ``settle`` rather than by a read (tests: nothing read them)
        index = (device.index if device.index is not None else cuda.current_device()) if pinned else None
        start = (lambda: cuda.set_device(index)) if pinned else None  # a new thread starts on device 0
        self._thread = ThreadPoolExecutor(1, "host-step", initializer=start) if self.order else None

    def host_bytes(self) -> int:
        """Masters and optimizer state held in host memory."""
        states = self.optimizer.states().values() if self.optimizer is not None else []
        held = list(self.masters.values()) + [t for s in states for t in s.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in held)

    def launch(self, lr: float, updates: dict[int, torch.Tensor], number: int) -> None:
        """Steps 1 and 2: the gradients (Muon's fragments: their ``updates``) to the host, and the host thread on
        its way."""
        self.settle()
        for i, host_grad in self.grads.items():
            host_grad.copy_(updates[i] if i in updates else self.fragments[i].grad, non_blocking=True)
        copied = None
        if self.device.type == "cuda":
            copied = cuda.Event()
            copied.record()
        self.lr, self.number = lr, number
        self.jobs = [self._thread.submit(self._step_bucket, self.members[id(bucket)], copied)
                     for _, bucket in self.order]
        self.done = 0
        if not self.overlap:
            self.settle(late=False)

    def _step_bucket(self, indices: list[int], copied) -> None:
        """Step 2, on the host thread, for one bucket's fragments (the optimizer skips masters without a grad)."""
        if copied is not None:
            copied.synchronize()  # the gradients have arrived in host memory
        if indices:
            self.optimizer.step(self.lr, {id(self.masters[i]): self.grads[i] for i in indices}, self.number)

    def finish(self, bucket) -> None:
        """``bucket``'s weights are about to be read: complete every offloaded bucket up to it, in order."""
        position = self.position.get(id(bucket))
        while position is not None and self.done <= position:
            self._complete()

    def settle(self, late: bool = True) -> None:
        """Complete every bucket (before the next step, a checkpoint, a load, or a read of every weight)."""
        while self.done < len(self.order):
            self.late += late
            self._complete()

    def _complete(self) -> None:
        """Step 3 for the next bucket in order."""
        store, bucket = self.order[self.done]
        self.jobs[self.done].result()  # re-raises a failure of the host step here, on the main thread
        for i in self.members[id(bucket)]:
            self.fragments[i].data.copy_(to_device(self.masters[i], self.device))
        store.publish(bucket)
        self.done += 1


def offload_step(model_chunks, buffers: list, fragments: list, opt, device: torch.device, units,
                 scales: dict[int, float | None], keys: list[tuple]) -> HostStep:
    """The host step of an optimizer's ``buffers`` (empty without ``optimizer.offload``), completed where the next
    forward needs a bucket: at its ZeRO-3 gather (``units``, or None), or at the first read of a weight of a
    replicated bucket. ``scales``: Muon's scale of each fragment's matrix (by index; absent or None: not Muon's);
    ``keys``: each fragment's stochastic-rounding stream (``low_precision.stream_key``)."""
    order = {id(p): i for i, p in enumerate(p for chunk in model_chunks for p in chunk.parameters())}
    host = HostStep([(b.weights, bucket) for b in buffers for bucket in b.buckets], fragments, opt, order, device,
                    scales, keys)
    watch_reads(model_chunks, {id(p): functools.partial(host.finish, bucket) for store, bucket in host.order
                               if not store.sharded for p in bucket.params})
    if units is not None:
        units.before_gather = host.finish
    return host
