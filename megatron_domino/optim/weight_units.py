"""ZeRO-3's gathers: a layer's weights all-gathered just before it computes and released after it, with the
next layer's gather in flight while it computes, in forward and in backward.

A *unit* is what is gathered and released together: one model chunk's embedding, one of its blocks, or its
output head (the unit's buckets, in the dense and the expert buffers). Each chunk uses its units in a known
order (``weight_hooks.unit_orders``): forward, the embedding, the blocks, the head; backward, the reverse.
A *touch* says that a unit is in use now (``weight_hooks``: a weight read in forward or in a recomputation,
a saved weight unpacked in backward). It places a window on that order: the touched unit and the
``prefetch_depth`` units after it are kept, those ahead gathered asynchronously (their all-gathers fly
while the touched one computes), and every other gathered unit is released. So at most 1 + prefetch_depth
units are held in full, whatever the pipeline schedule interleaves: a touch of another chunk, or of the
other direction, moves the one window there.

- ``reshard_after_forward`` false: forward releases nothing, so a layer's weights stay gathered from its
  forward to its backward (for stages holding few layers); backward releases as usual.
- Recompute: a recomputed forward reads its weights again (a touch in backward: it reuses the gathered unit
  that its backward holds anyway).
- ZB-H1's W pass unpacks the weights its nodes saved and gathers them again when I has moved on: keeping
  every layer from I to W would hold the whole stage.
Every data-parallel rank touches the same units in the same order, so the gathers (collectives over the
gradient group) are issued in the same order everywhere.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Unit:
    name: str  # "<chunk>:<module>", e.g. "0:layers.3"
    chunk: int  # index of the model chunk it belongs to
    parts: list = field(default_factory=list)  # (ShardedWeights, bucket) pairs
    works: list = field(default_factory=list)  # all-gathers in flight

    def nbytes(self) -> int:
        return sum(store.full(bucket).numel() * store.full(bucket).element_size() for store, bucket in self.parts)


class WeightUnits:
    """The units of a model's chunks, the window over their orders, and what happened (for tests and
    benchmarks: ``on_demand`` gathers that a computation waited for from the start, ``prefetched`` ones,
    ``peak_bytes`` held in full at once, and, when ``trace`` is a list, every touch with what was held)."""

    def __init__(self, units: list[Unit], orders: dict, prefetch_depth: int, reshard_after_forward: bool):
        self.units, self.orders = units, orders  # orders: (chunk, backward) -> [Unit]
        self.depth, self.reshard_after_forward = prefetch_depth, reshard_after_forward
        self.held: list[Unit] = []  # gathered or gathering, oldest first
        # a gathered bucket's storage -> its unit (for ``pack``): keyed by the storage itself (``_storage_key``),
        # not its data pointer, which is 0 for every storage of a rehearsal's fake tensors
        self.by_storage: dict[int, Unit] = {}
        self.where: tuple | None = None  # (chunk, backward, index into that order) of the last touch
        self.on_demand = self.prefetched = self.peak_bytes = 0
        self.trace: list | None = None
        self.before_gather = lambda bucket: None  # the host step completes an offloaded bucket's shard first

    # ----- the window -------------------------------------------------------------------------------------
    def touch(self, unit: Unit) -> None:
        """``unit`` is in use: gather it if need be, prefetch what follows, release the rest."""
        backward, chunk = torch._C._current_graph_task_id() != -1, unit.chunk
        order = self.orders[(chunk, backward)]
        same_pass = self.where is not None and self.where[:2] == (chunk, backward) and self.where[2] is not None
        if same_pass and order[self.where[2]] is unit:
            return  # the unit in use already: nothing moves
        index = _find(order, unit, self.where[2] if same_pass else 0)
        window = [unit] if index is None else order[index:index + 1 + self.depth]
        if backward or self.reshard_after_forward:
            for held in [u for u in self.held if u not in window]:
                self.release(held)
        self._ensure(unit)
        for ahead in window[1:]:
            if ahead not in self.held:
                self._launch(ahead, async_op=True)
                self.prefetched += 1
        self.where = (chunk, backward, index)
        if self.trace is not None:
            self.trace.append((unit.name, backward, {u.name: "flying" if u.works else "gathered" for u in self.held}))

    def _ensure(self, unit: Unit) -> None:
        if unit not in self.held:
            self._launch(unit, async_op=False)
            self.on_demand += 1
        for work in unit.works:
            work.wait()
        unit.works = []

    def _launch(self, unit: Unit, async_op: bool) -> None:
        for _, bucket in unit.parts:
            self.before_gather(bucket)
        works = [store.gather(bucket, async_op) for store, bucket in unit.parts]
        unit.works = [work for work in works if work is not None and async_op]
        self.held.append(unit)
        for store, bucket in unit.parts:
            self.by_storage[_storage_key(store.full(bucket))] = unit
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    def release(self, unit: Unit) -> None:
        for work in unit.works:  # a prefetch still in flight writes into the storage: let it land first
            work.wait()
        unit.works = []
        for store, bucket in unit.parts:
            self.by_storage.pop(_storage_key(store.full(bucket)), None)
            store.release(bucket)
        self.held.remove(unit)

    def release_all(self) -> None:
        """Between steps (the weights are about to change) and after a load: nothing stays gathered."""
        for unit in list(self.held):
            self.release(unit)
        self.where = None

    @contextmanager
    def all_gathered(self):
        """Every unit gathered within (FSDP's ``summon_full_params``): to read the whole weights of a live
        model, e.g. to export or compare them. Collective over each unit's gradient group."""
        self.release_all()
        for unit in self.units:
            self._launch(unit, async_op=False)
        try:
            yield
        finally:
            self.release_all()

    def held_bytes(self) -> int:
        return sum(unit.nbytes() for unit in self.held)

    # ----- backward: ``saved_tensors_hooks`` around each chunk's forward -----------------------------------
    def pack(self, tensor: torch.Tensor, outer=None):
        """A tensor autograd saves: a gathered weight (or a view of one) is remembered with its unit; anything
        else goes to the ``outer`` pack hook, if hooks were installed around ours (activation offload, the
        rehearsal's accounting), or is kept as a detached alias: the tensor itself, where it is its node's own
        output, would hold that node, a cycle only a whole backward breaks; a split backward's I-only nodes
        would then never be freed (a leak per micro-batch under zb-h1, zb-v, dualpipev)."""
        unit = self.by_storage.get(_storage_key(tensor))
        if unit is None:
            return tensor.detach() if outer is None else outer(tensor)
        return _SavedWeight(unit, tensor)

    def unpack(self, packed, outer=None):
        """Backward needs a saved tensor: a weight's unit is touched (gathered again if it was released)."""
        if isinstance(packed, _SavedWeight):
            self.touch(packed.unit)
            return packed.tensor
        return packed if outer is None else outer(packed)


@dataclass
class _SavedWeight:
    unit: Unit
    tensor: torch.Tensor


def _find(order: list[Unit], unit: Unit, start: int) -> int | None:
    """The first position of ``unit`` in ``order`` at or after ``start`` (else from the beginning)."""
    for begin in (start, 0):
        for index in range(begin, len(order)):
            if order[index] is unit:
                return index
    return None


def _storage_key(tensor: torch.Tensor) -> int:
    """The address of the storage behind ``tensor`` (and all its views), unique among live storages."""
    return tensor.untyped_storage()._cdata
