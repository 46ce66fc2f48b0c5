"""Contiguous gradient buffers, cut into buckets that are reduced over data parallelism as soon as they fill.

Why contiguous: a bucket is then one tensor, reduced by one collective and zeroed by one memset, and
each parameter's ``.main_grad`` is a view into it. Parameters are laid out in reverse registration
order, which approximates the order backward produces their gradients: the last layers' bucket fills
first and starts reducing while earlier layers still compute. The weights themselves are moved into
a parameter buffer with the same layout, so ZeRO's all-gather writes updated shards straight into
the model.

Sharding (ZeRO-1/2): every bucket is padded to a multiple of ``shards * ALIGN`` elements and cut into
``shards`` equal, aligned pieces; DP rank r owns piece r. The reduce-scatter runs in place: its output is
the rank's own piece of its input (NCCL's in-place rule, recvbuff = sendbuff + rank * count; gloo copies),
so no second, shard-sized gradient is kept.
- ZeRO-1 keeps the full gradient buffer all step (6 + 12/d bytes per bf16 weight with fp32 gradients and
  Adam), accumulates every micro-batch into it, and reduce-scatters each bucket once, in the last backward.
- ZeRO-2 keeps only the reduced shard (2 + 16/d): a bucket's full gradient is allocated when a backward pass
  first writes it, reduce-scattered as soon as that pass has written all of it (or when the next pass
  begins), added into the shard and freed, on every micro-batch, as DeepSpeed's stage 2 does. At most
  ``IN_FLIGHT`` reductions run behind backward (a third waits for the oldest: on CUDA the stream waits, not
  the host); with ``overlap_grad_reduce`` off each is waited for at once. It costs a reduce-scatter per
  bucket and micro-batch instead of one per step.

The layout is a pure function of the parameter list (order and shapes), the bucket size and the shard
count, so ranks holding the same parameters (the TP ranks of one stage) agree on it. Parameters marked
``alone`` (the word embeddings and their tied copy on the last pipeline stage) get a bucket of their own:
their shard ranges then depend on their shape only, and the embedding group can all-reduce matching shards
across stages whose other parameters differ.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..parallel.comm import all_gather_flat, reduce_scatter_flat

ALIGN = 128  # elements: shard boundaries land on 256-byte (bf16) / 512-byte (fp32) multiples
IN_FLIGHT = 2  # ZeRO-2: full buckets whose reduction may still run while backward goes on


@dataclass
class BucketLayout:
    params: list  # in backward order
    offsets: list[int]  # element offset of each parameter inside the bucket
    size: int  # padded number of elements


def _round_up(value: int, multiple: int) -> int:
    return multiple * -(-value // multiple)


def plan_buckets(params: list, bucket_elems: int, shards: int,
                 alone: Callable[[torch.Tensor], bool] = lambda p: False) -> list[BucketLayout]:
    """Consecutive parameters fill a bucket until it holds at least ``bucket_elems`` elements."""
    layouts: list[BucketLayout] = []
    members, offsets, filled = [], [], 0

    def close():
        nonlocal members, offsets, filled
        if members:
            layouts.append(BucketLayout(members, offsets, _round_up(filled, shards * ALIGN)))
        members, offsets, filled = [], [], 0

    for param in params:
        single = alone(param)
        if single:
            close()
        members.append(param)
        offsets.append(filled)
        filled += param.numel()
        if single or filled >= bucket_elems:
            close()
    close()
    return layouts


@dataclass
class Fragment:
    """The part of one parameter that this rank steps: elements [start, end) of the flattened parameter."""

    param: torch.Tensor
    bucket: "Bucket"
    start: int
    end: int
    shard_offset: int  # where the fragment begins inside the bucket's shard
    grad: torch.Tensor  # 1-D view of the DP-reduced gradient
    data: torch.Tensor  # 1-D view of the model weight (parameter dtype)


class Bucket:
    """One reduction unit: its full-size gradient (``grad``) and this rank's reduced piece (``reduced``)."""

    def __init__(self, layout: BucketLayout, start: int, shards: int, shard_index: int):
        self.params, self.offsets, self.size = layout.params, layout.offsets, layout.size
        self.start = start  # offset of the bucket inside its buffer
        self.shard_size = self.size // shards
        self.shard_start = shard_index * self.shard_size  # inside the bucket
        self.grad: torch.Tensor | None = None
        self.reduced: torch.Tensor | None = None
        self.work = None
        self.ready: set[int] = set()  # ids of parameters whose gradient of this pass has arrived

    def attach(self, grad: torch.Tensor) -> None:
        self.grad = grad
        for param, offset in zip(self.params, self.offsets):
            param.main_grad = grad[offset:offset + param.numel()].view_as(param)

    def own_piece(self) -> torch.Tensor:
        """This rank's piece of the full gradient: where the in-place reduce-scatter leaves the sum."""
        return self.grad[self.shard_start:self.shard_start + self.shard_size]

    def release(self) -> None:
        self.grad = None
        for param in self.params:
            param.main_grad = None

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)


class GradBuffer:
    """The parameters of one model chunk and dtype: their weights, gradients, buckets and DP reductions.

    ``shard``: reduce-scatter (ZeRO-1/2) instead of all-reduce. ``release``: ZeRO-2 (see the module docstring).
    """

    def __init__(self, params: list, grad_dtype: torch.dtype, bucket_elems: int, group, *, shard: bool,
                 release: bool, alone: Callable[[torch.Tensor], bool] = lambda p: False):
        size = dist.get_world_size(group) if group is not None else 1
        shard = shard and size > 1  # one replica (an expert's, when ep = dp): nothing to shard, nothing to release
        self.group, self.grad_dtype, self.release = group, grad_dtype, release and shard
        self.shards = size if shard else 1
        self.rank = dist.get_rank(group) if shard else 0
        self.device = params[0].device
        layouts = plan_buckets(params, bucket_elems, self.shards, alone)
        total = sum(layout.size for layout in layouts)
        self.param_data = torch.zeros(total, dtype=params[0].dtype, device=self.device)
        self.grad_data = None if self.release else torch.zeros(total, dtype=grad_dtype, device=self.device)
        self.shard_data = (torch.zeros(total // self.shards, dtype=grad_dtype, device=self.device)
                           if self.release else None)  # ZeRO-2: the reduced shards, summed over micro-batches
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, Bucket] = {}
        start = 0
        for layout in layouts:
            bucket = Bucket(layout, start, self.shards, self.rank)
            self._adopt_weights(bucket)
            if self.release:
                begin = start // self.shards
                bucket.reduced = self.shard_data[begin:begin + bucket.shard_size]
            else:
                bucket.attach(self.grad_data[start:start + bucket.size])
                bucket.reduced = bucket.own_piece()
            self.buckets.append(bucket)
            start += bucket.size
        self.params = [p for b in self.buckets for p in b.params]
        self._next = 0  # next bucket to launch in this pass: launches follow bucket order on every rank
        self._flying: list[Bucket] = []  # launched, not yet finished, oldest first
        self.launches = 0
        self.peak_grad_elements = self._held_elements()

    def _adopt_weights(self, bucket: Bucket) -> None:
        """Make each weight a view of the parameter buffer (same values, new storage)."""
        for param, offset in zip(bucket.params, bucket.offsets):
            view = self.param_data[bucket.start + offset:bucket.start + offset + param.numel()].view_as(param)
            view.copy_(param.data)
            param.data = view
            self.bucket_of[id(param)] = bucket

    def fragments(self) -> list[Fragment]:
        """The pieces of parameters inside this rank's shard of each bucket (all of them without sharding)."""
        found = []
        for bucket in self.buckets:
            lo, hi = bucket.shard_start, bucket.shard_start + bucket.shard_size
            for param, offset in zip(bucket.params, bucket.offsets):
                begin, end = max(offset, lo), min(offset + param.numel(), hi)
                if begin >= end:
                    continue
                data = self.param_data[bucket.start + begin:bucket.start + end]
                found.append(Fragment(param, bucket, begin - offset, end - offset, begin - lo,
                                      bucket.reduced[begin - lo:end - lo], data))
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

    # ----- weights -------------------------------------------------------------------------------
    def gather_params(self) -> None:
        """ZeRO-1/2: every rank receives every other rank's updated shard (a no-op without sharding)."""
        if self.shards == 1:
            return
        works = []
        for bucket in self.buckets:
            full = self.param_data[bucket.start:bucket.start + bucket.size]
            mine = full[bucket.shard_start:bucket.shard_start + bucket.shard_size].clone()  # input may not alias
            works.append(all_gather_flat(full, mine, group=self.group, async_op=True))
        for work in works:
            work.wait()

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
