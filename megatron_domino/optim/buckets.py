"""How a buffer's parameters are cut into buckets, and what a bucket and a rank's piece of it are.

A bucket is one reduction unit: consecutive parameters (in backward order) that together hold at least the
bucket size, padded to a multiple of ``shards * ALIGN`` elements and cut into ``shards`` equal, aligned pieces;
data-parallel rank r owns piece r. The layout is a pure function of the parameter list (order and shapes),
the bucket size, the shard count and the two closing rules below, so ranks holding the same parameters (the TP
ranks of one stage) agree on it:
- a parameter marked ``alone`` (the word embeddings and their tied copy on the last pipeline stage) gets a
  bucket of its own: its shard ranges then depend on its shape only, and the embedding group can all-reduce
  matching shards across stages whose other parameters differ;
- ZeRO-3 (``unit_of``): a bucket never spans two gather units (layers), so a layer's weights are gathered
  and freed by whole buckets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ALIGN = 128  # elements: shard boundaries land on 256-byte (bf16) / 512-byte (fp32) multiples


@dataclass
class BucketLayout:
    params: list  # in backward order
    offsets: list[int]  # element offset of each parameter inside the bucket
    size: int  # padded number of elements


def _round_up(value: int, multiple: int) -> int:
    return multiple * -(-value // multiple)


def plan_buckets(params: list, bucket_elems: int, shards: int,
                 alone: Callable[[torch.Tensor], bool] = lambda p: False,
                 unit_of: Callable[[torch.Tensor], object] = lambda p: None) -> list[BucketLayout]:
    """Consecutive parameters of one unit fill a bucket until it holds at least ``bucket_elems`` elements."""
    layouts: list[BucketLayout] = []
    members, offsets, filled = [], [], 0

    def close():
        nonlocal members, offsets, filled
        if members:
            layouts.append(BucketLayout(members, offsets, _round_up(filled, shards * ALIGN)))
        members, offsets, filled = [], [], 0

    for param in params:
        single = alone(param)
        if single or (members and unit_of(param) != unit_of(members[-1])):
            close()
        members.append(param)
        offsets.append(filled)
        filled += param.numel()
        if single or filled >= bucket_elems:
            close()
    close()
    return layouts


def shaped_views(flat: torch.Tensor, params: list, offsets: list[int]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``params``, parameter i at element ``offsets[i]``. Parameters of one shape at
    evenly spaced offsets (an MoE layer's experts) take two tensor ops however many they are: a rehearsal's fake
    tensors pay a dispatch for every op, and view by view, building the buffers of a model with thousands of experts
    took a fifth of its rehearsal."""
    views: list = [None] * len(params)
    by_shape: dict[tuple, list[int]] = {}
    for index, param in enumerate(params):
        by_shape.setdefault(tuple(param.shape), []).append(index)
    for shape, members in by_shape.items():
        strides = [1] * len(shape)
        for dim in range(len(shape) - 2, -1, -1):
            strides[dim] = strides[dim + 1] * shape[dim + 1]
        start = 0
        while start < len(members):  # a run of members at equal steps: one strided view of them all
            end = start + 1
            step = offsets[members[end]] - offsets[members[start]] if end < len(members) else 0
            while end < len(members) and offsets[members[end]] - offsets[members[end - 1]] == step:
                end += 1
            first = offsets[members[start]]
            run = (flat.as_strided((end - start, *shape), (step, *strides), flat.storage_offset() + first).unbind(0)
                   if end - start > 1 else [flat.narrow(0, first, params[members[start]].numel()).view(shape)])
            for index, view in zip(members[start:end], run):
                views[index] = view
            start = end
    return views


@dataclass
class Fragment:
    """The part of one parameter that this rank steps: elements [start, end) of the flattened parameter."""

    param: torch.Tensor
    bucket: "Bucket"
    start: int
    end: int
    shard_offset: int  # where the fragment begins inside the bucket's shard
    grad: torch.Tensor  # 1-D view of the DP-reduced gradient
    data: torch.Tensor  # 1-D view of the model weight (parameter dtype); under ZeRO-3, of the weight shard


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
        for param, view in zip(self.params, shaped_views(grad, self.params, self.offsets)):
            param.main_grad = view

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
