"""Where a gradient buffer's weights live: whole on every rank (ZeRO-0/1/2) or sharded (ZeRO-3).

Either way each weight is a view into storage laid out like the gradients (``buckets``), so the optimizer
writes its updated shard straight into the model and one collective per bucket moves a bucket's weights.
- ``ReplicatedWeights``: one flat tensor holds every weight; after the step each rank's updated piece is
  all-gathered into the others' (a no-op without sharding); a bucket stepped on the host (``host_step``) is
  all-gathered later, when the next forward first reads it (``publish``).
- ``ShardedWeights``: the rank keeps only its piece of each bucket (2/d bytes per bf16 weight); the bucket's
  full weights are a tensor of their own whose storage is allocated and all-gathered when its layer is
  needed (``gather``) and shrunk to nothing afterwards (``release``). The parameters stay views of that
  storage throughout, so autograd's saved references to them (and to views of them, such as ``weight.t()``)
  see the gathered values again once it is refilled; reading a released weight fails loudly (a storage of
  size 0), it never reads stale memory.
"""
from __future__ import annotations

import torch

from ..parallel.comm import all_gather_flat
from .buckets import shaped_views


@torch.no_grad()
def _adopt(bucket, full: torch.Tensor) -> None:
    """Make each of the bucket's weights a view of ``full`` (same values, new storage)."""
    views = shaped_views(full, bucket.params, bucket.offsets)
    torch._foreach_copy_(views, bucket.params)
    for param, view in zip(bucket.params, views):
        param.data = view


class ReplicatedWeights:
    """ZeRO-0/1/2: every weight on every rank, in one flat tensor."""

    sharded = False

    def __init__(self, buckets: list, dtype: torch.dtype, device: torch.device, group, shards: int):
        self.buckets, self.group, self.shards = buckets, group, shards
        self.data = torch.zeros(sum(b.size for b in buckets), dtype=dtype, device=device)
        for bucket in buckets:
            _adopt(bucket, self.full(bucket))

    def full(self, bucket) -> torch.Tensor:
        return self.data[bucket.start:bucket.start + bucket.size]

    def own(self, bucket) -> torch.Tensor:
        """This rank's piece of the bucket's weights: what its optimizer step writes."""
        return self.full(bucket)[bucket.shard_start:bucket.shard_start + bucket.shard_size]

    def after_step(self, deferred: set[int]) -> None:
        """Every rank receives every other rank's updated piece, except of the ``deferred`` buckets (by id)."""
        if self.shards == 1:
            return
        works = [self._all_gather(b) for b in self.buckets if id(b) not in deferred]
        for work in works:
            work.wait()

    def publish(self, bucket) -> None:
        """One bucket's updated pieces to every rank (a deferred bucket, once its host step is done)."""
        if self.shards > 1:
            self._all_gather(bucket).wait()

    def _all_gather(self, bucket):
        return all_gather_flat(self.full(bucket), self.own(bucket).clone(), group=self.group, async_op=True)

    def resident_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class ShardedWeights:
    """ZeRO-3: this rank's piece of every bucket, and each bucket's full weights only while gathered."""

    sharded = True

    def __init__(self, buckets: list, dtype: torch.dtype, device: torch.device, group, shards: int):
        self.buckets, self.group, self.shards = buckets, group, shards
        self.shard = torch.zeros(sum(b.size for b in buckets) // shards, dtype=dtype, device=device)
        self.fulls = []
        for bucket in buckets:
            full = torch.zeros(bucket.size, dtype=dtype, device=device)
            _adopt(bucket, full)  # every rank built the same weights: keep its own piece of them
            self.fulls.append(full)
            self.own(bucket).copy_(full[bucket.shard_start:bucket.shard_start + bucket.shard_size])
        self.index = {id(b): i for i, b in enumerate(buckets)}
        for bucket in buckets:
            self.release(bucket)

    def own(self, bucket) -> torch.Tensor:
        begin = bucket.start // self.shards
        return self.shard[begin:begin + bucket.shard_size]

    def full(self, bucket) -> torch.Tensor:
        return self.fulls[self.index[id(bucket)]]

    def is_gathered(self, bucket) -> bool:
        return self.full(bucket).untyped_storage().size() > 0

    def gather(self, bucket, async_op: bool):
        """Allocate the bucket's full weights and all-gather every rank's piece into them (a work, or None)."""
        full = self.full(bucket)
        full.untyped_storage().resize_(full.numel() * full.element_size())
        return all_gather_flat(full, self.own(bucket), group=self.group, async_op=async_op)

    def release(self, bucket) -> None:
        self.full(bucket).untyped_storage().resize_(0)

    def after_step(self, deferred: set[int]) -> None:
        """Nothing: the updated shards are gathered when their layers are next used."""

    def publish(self, bucket) -> None:
        """Nothing: the shard holds the update, and the next gather of its layer moves it."""

    def resident_bytes(self) -> int:
        """The shard and whatever buckets are gathered now."""
        held = [self.shard] + [full for full in self.fulls if full.untyped_storage().size() > 0]
        return sum(t.numel() * t.element_size() for t in held)
