"""Contiguous gradient buffers, cut into buckets that are reduced over data parallelism as soon as they fill.

Why contiguous: a bucket is then one tensor, reduced by one collective and zeroed by one memset, and
each parameter's ``.main_grad`` is a view into it. Parameters are laid out in reverse registration
order, which approximates the order backward produces their gradients: the last layers' bucket fills
first and starts reducing while earlier layers still compute. The weights themselves are moved into
a parameter buffer with the same layout, so ZeRO's all-gather writes updated shards straight into
the model.

Sharding (ZeRO-1/2): every bucket is padded to a multiple of ``shards * ALIGN`` elements and cut into
``shards`` equal, aligned pieces; DP rank r owns piece r. The layout is a pure function of the
parameter list (order and shapes), the bucket size and the shard count, so ranks holding the same
parameters (the TP ranks of one stage) agree on it. Parameters marked ``alone`` (the word embeddings
and their tied copy on the last pipeline stage) get a bucket of their own: their shard ranges then
depend on their shape only, and the embedding group can all-reduce matching shards across stages
whose other parameters differ.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..parallel.comm import all_gather_flat, reduce_scatter_flat

ALIGN = 128  # elements: shard boundaries land on 256-byte (bf16) / 512-byte (fp32) multiples


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
    """One reduction unit: its full-size gradient (``grad``) and the part this rank keeps (``reduced``)."""

    def __init__(self, layout: BucketLayout, start: int, shards: int, shard_index: int):
        self.params, self.offsets, self.size = layout.params, layout.offsets, layout.size
        self.start = start  # offset of the bucket inside its buffer
        self.shard_size = self.size // shards
        self.shard_start = shard_index * self.shard_size  # inside the bucket
        self.grad: torch.Tensor | None = None
        self.reduced: torch.Tensor | None = None
        self.work = None
        self.ready: set[int] = set()  # ids of parameters whose last-micro-batch gradient has arrived

    def attach(self, grad: torch.Tensor) -> None:
        self.grad = grad
        for param, offset in zip(self.params, self.offsets):
            param.main_grad = grad[offset:offset + param.numel()].view_as(param)

    def release(self) -> None:
        self.grad = None
        for param in self.params:
            param.main_grad = None

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)


class GradBuffer:
    """The parameters of one model chunk and dtype: their weights, gradients, buckets and DP reductions.

    ``shard``: reduce-scatter (ZeRO-1/2) instead of all-reduce. ``release``: ZeRO-2, where a bucket's
    full-size gradient exists only from its first gradient of a step until its reduction completes.
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
        self.reduced_data = (torch.zeros(total // self.shards, dtype=grad_dtype, device=self.device)
                             if shard else self.grad_data)
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, Bucket] = {}
        start = 0
        for layout in layouts:
            bucket = Bucket(layout, start, self.shards, self.rank)
            self._adopt_weights(bucket)
            if self.grad_data is not None:
                bucket.attach(self.grad_data[start:start + bucket.size])
            begin = start // self.shards
            bucket.reduced = self.reduced_data[begin:begin + bucket.shard_size]
            self.buckets.append(bucket)
            start += bucket.size
        self.params = [p for b in self.buckets for p in b.params]
        self._next = 0  # next bucket to launch: launches follow bucket order on every rank
        self.launches = 0

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

    # ----- gradients -----------------------------------------------------------------------------
    def accumulate(self, param: torch.Tensor, last_microbatch: bool, overlap: bool) -> None:
        """Called after autograd accumulated ``param.grad``: move it into ``main_grad``, maybe launch."""
        bucket = self.bucket_of[id(param)]
        track = last_microbatch and overlap
        if track and id(param) in bucket.ready:
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} received a second gradient in the last micro-batch, "
                f"after its bucket was marked ready for the DP reduction (a weight used by two separate backward "
                f"passes?). Fix: set optimizer.overlap_grad_reduce = false, or call set_last_microbatch(True) only "
                f"before the last backward.")
        if bucket.grad is None:
            bucket.attach(torch.zeros(bucket.size, dtype=self.grad_dtype, device=self.device))
        param.main_grad.add_(param.grad)
        param.grad = None
        if track:
            bucket.ready.add(id(param))
            self._launch_ready()

    def _launch_ready(self) -> None:
        launched = self._next
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._launch(self.buckets[self._next])
        if self.release and self._next > launched:
            self._release_finished()

    def _launch(self, bucket: Bucket) -> None:
        if bucket.grad is None:  # no gradient reached it this step (unused parameters): reduce zeros
            bucket.attach(torch.zeros(bucket.size, dtype=self.grad_dtype, device=self.device))
        if self.shards > 1:
            bucket.work = reduce_scatter_flat(bucket.reduced, bucket.grad, group=self.group, async_op=True)
        elif self.group is not None and dist.get_world_size(self.group) > 1:
            bucket.work = dist.all_reduce(bucket.grad, group=self.group, async_op=True)
        self.launches += 1
        self._next += 1

    def _release_finished(self) -> None:
        """ZeRO-2: drop the full-size gradient of every bucket whose reduce-scatter has completed."""
        for bucket in self.buckets[:self._next]:
            if bucket.grad is not None and (bucket.work is None or bucket.work.is_completed()):
                self._wait(bucket)
                bucket.release()

    @staticmethod
    def _wait(bucket: Bucket) -> None:
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None

    def launch_remaining(self) -> None:
        """Launch, in order, what backward has not launched (overlap off, or buckets left incomplete)."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])

    def wait(self) -> None:
        """Wait for every launched reduction and reset for the next step (ZeRO-2 drops full gradients)."""
        for bucket in self.buckets:
            self._wait(bucket)
            bucket.ready.clear()
            if self.release:
                bucket.release()
        self._next = 0

    def zero(self) -> None:
        self.wait()
        if self.grad_data is not None:
            self.grad_data.zero_()

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

    def grad_bytes(self) -> int:
        """Gradient memory held now: the full buffer (ZeRO-0/1) or attached buckets (ZeRO-2), plus shards."""
        held = self.grad_data.numel() if self.grad_data is not None else sum(
            b.size for b in self.buckets if b.grad is not None)
        if self.reduced_data is not self.grad_data:
            held += self.reduced_data.numel()
        return held * self.reduced_data.element_size()
