"""Contiguous gradient buffers, cut into buckets that are reduced over data parallelism as soon as they fill.

Why contiguous: a bucket is then one tensor, reduced by one collective and zeroed by one memset, and
each parameter's ``.main_grad`` is a view into it. Parameters are laid out in reverse registration
order, which approximates the order backward produces their gradients: the last layers' bucket fills
first and starts reducing while earlier layers still compute. The weights themselves are moved into
storage with the same layout (``weight_store``), so ZeRO's all-gathers move them bucket by bucket.

Sharding (ZeRO-1/2/3): buckets (``buckets``) are cut into ``shards`` equal pieces; DP rank r owns piece r of
each. The reduce-scatter runs in place: its output is the rank's own piece of its input (NCCL's in-place rule,
recvbuff = sendbuff + rank * count; gloo copies), so no second, shard-sized gradient is kept.
- ZeRO-1 keeps the full gradient buffer all step (6 + 12/d bytes per bf16 weight with fp32 gradients and
  Adam), accumulates every micro-batch into it, and reduce-scatters each bucket once, in the last backward.
- ZeRO-2 keeps only the reduced shard (2 + 16/d): a bucket's full gradient is allocated when a backward pass
  first writes it, reduce-scattered as soon as that pass has written all of it (or when the next pass
  begins), added into the shard and freed, on every micro-batch, as DeepSpeed's stage 2 does. At most
  ``IN_FLIGHT`` reductions run behind backward (a third waits for the oldest: on CUDA the stream waits, not
  the host); with ``overlap_grad_reduce`` off each is waited for at once. It costs a reduce-scatter per
  bucket and micro-batch instead of one per step.
- ZeRO-3 reduces gradients as ZeRO-2 does and keeps only its piece of the weights too
  (``weight_store.ShardedWeights``; ``weight_units`` gathers them layer by layer).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..parallel.comm import reduce_scatter_flat
from .buckets import Bucket, Fragment, plan_buckets
from .weight_store import ReplicatedWeights, ShardedWeights

IN_FLIGHT = 2  # ZeRO-2/3: full gradient buckets whose reduction may still run while backward goes on


class GradBuffer:
    """The parameters of one model chunk and dtype: their weights, gradients, buckets and DP reductions.

    ``shard``: reduce-scatter (ZeRO-1/2/3) instead of all-reduce. ``release``: ZeRO-2/3 gradients (see the module
    docstring). ``shard_weights``: ZeRO-3 weights, in buckets that never span two ``unit_of`` values.
    """

    def __init__(self, params: list, grad_dtype: torch.dtype, bucket_elems: int, group, *, shard: bool,
                 release: bool, alone: Callable[[torch.Tensor], bool] = lambda p: False,
                 shard_weights: bool = False, unit_of: Callable[[torch.Tensor], object] = lambda p: None):
        size = dist.get_world_size(group) if group is not None else 1
        shard = shard and size > 1  # one replica (an expert's, when ep = dp): nothing to shard, nothing to release
        self.group, self.grad_dtype, self.release = group, grad_dtype, release and shard
        self.shards = size if shard else 1
        self.rank = dist.get_rank(group) if shard else 0
        self.device = params[0].device
        layouts = plan_buckets(params, bucket_elems, self.shards, alone, unit_of if shard_weights else lambda p: None)
        total = sum(layout.size for layout in layouts)
        self.grad_data = None if self.release else torch.zeros(total, dtype=grad_dtype, device=self.device)
        self.shard_data = (torch.zeros(total // self.shards, dtype=grad_dtype, device=self.device)
                           if self.release else None)  # ZeRO-2: the reduced shards, summed over micro-batches
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, Bucket] = {}
        start = 0
        for layout in layouts:
            bucket = Bucket(layout, start, self.shards, self.rank)
            self.bucket_of.update((id(param), bucket) for param in bucket.params)
            if self.release:
                begin = start // self.shards
                bucket.reduced = self.shard_data[begin:begin + bucket.shard_size]
            else:
                bucket.attach(self.grad_data[start:start + bucket.size])
                bucket.reduced = bucket.own_piece()
            self.buckets.append(bucket)
            start += bucket.size
        store = ShardedWeights if shard_weights and self.shards > 1 else ReplicatedWeights
        self.weights = store(self.buckets, params[0].dtype, self.device, self.group, self.shards)
        self.params = [p for b in self.buckets for p in b.params]
        self._next = 0  # next bucket to launch in this pass: launches follow bucket order on every rank
        self._flying: list[Bucket] = []  # launched, not yet finished, oldest first
        self.launches = 0
        self.peak_grad_elements = self._held_elements()

    def fragments(self) -> list[Fragment]:
        """The pieces of parameters inside this rank's shard of each bucket (all of them without sharding)."""
        found = []
        for bucket in self.buckets:
            lo, hi = bucket.shard_start, bucket.shard_start + bucket.shard_size
            cuts = [(param, offset, max(offset, lo), min(offset + param.numel(), hi))
                    for param, offset in zip(bucket.params, bucket.offsets)]
            cuts = [cut for cut in cuts if cut[2] < cut[3]]  # the parameters tile the shard from its start
            if not cuts:
                continue
            sizes = [end - begin for _, _, begin, end in cuts]
            sizes.append(bucket.shard_size - sum(sizes))  # the padding after the last parameter
            pieces = zip(self.weights.own(bucket).split(sizes), bucket.reduced.split(sizes))  # two ops per bucket
            for (param, offset, begin, end), (data, grad) in zip(cuts, pieces):
                found.append(Fragment(param, bucket, begin - offset, end - offset, begin - lo, grad, data))
        return found

    def reduced(self) -> list[torch.Tensor]:
        """This rank's reduced gradient, one tensor per bucket (valid after ``wait``)."""
        return [bucket.reduced for bucket in self.buckets]

    # ----- gradients -----------------------------------------------------------------------------
    def begin_pass(self) -> None:
        """A backward pass (B, I or W) is about to run. ZeRO-2 reduces what the previous pass left and
        starts counting afresh; ZeRO-0/1 reduce once per step, in the last passes, and count across them."""
        if not self.release:
            return
        self.launch_remaining()
        self._next = 0
        for bucket in self.buckets:
            bucket.ready.clear()

    def accumulate(self, param: torch.Tensor, last_microbatch: bool, overlap: bool) -> None:
        """Called after autograd accumulated ``param.grad``: move it into ``main_grad``, maybe launch."""
        bucket = self.bucket_of[id(param)]
        track = self.release or (overlap and last_microbatch)  # ZeRO-2 reduces each bucket once it is written
        if track and id(param) in bucket.ready:
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} received a second gradient in one backward pass, after "
                f"its bucket was marked ready for the DP reduction (a weight used by two separate backward passes "
                f"without begin_backward between them?). Fix: set optimizer.overlap_grad_reduce = false, or call "
                f"begin_backward before every backward pass.")
        if bucket.work is not None:  # ZeRO-2: the bucket's previous pass is still being reduced
            self._finish(bucket)
        if bucket.grad is None:
            self._attach_new(bucket)
        param.main_grad.add_(param.grad)
        param.grad = None
        if track:
            bucket.ready.add(id(param))
            self._launch_ready(wait=not overlap)

    def _attach_new(self, bucket: Bucket) -> None:
        bucket.attach(torch.zeros(bucket.size, dtype=self.grad_dtype, device=self.device))
        self.peak_grad_elements = max(self.peak_grad_elements, self._held_elements())

    def _launch_ready(self, wait: bool) -> None:
        """Launch the complete buckets in order; ``wait``: finish each at once (ZeRO-2 without overlap)."""
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._launch(self.buckets[self._next])
            if wait:
                self._finish(self.buckets[self._next - 1])
        if self.release:  # free what has been reduced; beyond IN_FLIGHT buckets, wait for the oldest
            for index, bucket in enumerate(list(self._flying)):
                if index < len(self._flying) - IN_FLIGHT or bucket.work.is_completed():
                    self._finish(bucket)

    def _launch(self, bucket: Bucket) -> None:
        self._next += 1
        if self.release and (bucket.grad is None or bucket.work is not None):
            return  # ZeRO-2: nothing written since its last reduction (a write would have finished that first)
        if bucket.grad is None:
            self._attach_new(bucket)  # unused parameters: reduce zeros
        if self.shards > 1:
            bucket.work = reduce_scatter_flat(bucket.own_piece(), bucket.grad, group=self.group, async_op=True)
        elif self.group is not None and dist.get_world_size(self.group) > 1:
            bucket.work = dist.all_reduce(bucket.grad, group=self.group, async_op=True)
        if bucket.work is not None:
            self._flying.append(bucket)
        self.launches += 1

    def _finish(self, bucket: Bucket) -> None:
        """Wait for the bucket's reduction; ZeRO-2 adds its piece into the shard and frees the full gradient."""
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
            self._flying.remove(bucket)
        if self.release and bucket.grad is not None:
            bucket.reduced.add_(bucket.own_piece())
            bucket.release()

    def launch_remaining(self) -> None:
        """Launch, in order, what backward has not launched (overlap off, or buckets left incomplete)."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])

    def wait(self) -> None:
        """Wait for every launched reduction and reset for the next step."""
        for bucket in self.buckets:
            self._finish(bucket)
            bucket.ready.clear()
        self._next = 0

    def zero(self) -> None:
        self.wait()
        for data in (self.grad_data, self.shard_data):
            if data is not None:
                data.zero_()

    def after_step(self, deferred: set[int]) -> None:
        """The updated weights where the next forward reads them (``weight_store``), but for the ``deferred``
        buckets (ids), which the host still steps (``host_step``)."""
        self.weights.after_step(deferred)

    def _held_elements(self) -> int:
        if not self.release:
            return self.grad_data.numel()
        return self.shard_data.numel() + sum(b.size for b in self.buckets if b.grad is not None)

    def grad_bytes(self) -> int:
        """Gradient memory held now: the full buffer (ZeRO-0/1), or the shards and the buckets being reduced
        (ZeRO-2)."""
        return self._held_elements() * self.grad_dtype.itemsize

    def peak_grad_bytes(self) -> int:
        """The most gradient memory held at once since the buffer was built."""
        return self.peak_grad_elements * self.grad_dtype.itemsize
