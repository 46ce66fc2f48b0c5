"""Barriers over the launcher's key-value store, for the long phases: index build, checkpoint save and load.

A ``dist.barrier()`` there would be an NCCL collective: it aborts after ``parallel.collective_timeout_s``
however long the phase may legitimately take (rank 0 building an index for an hour), and the abort names
no one. Waiting on the store instead (the TCPStore that rendezvous started, which also carries the
watchdog's heartbeats) lets each wait run on the phase's own budget, report progress while ranks
arrive (so the watchdog sees a live phase, not a hang), and name the ranks that never came.

``Phase`` bundles what such a stretch of work needs: its name, its budget and the setting that holds
it, its latest progress (read by the watchdog) and its barriers.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable

import torch.distributed as dist

_MAX_POLL_S = 0.5


class StoreBarrierTimeout(TimeoutError):
    pass


class StoreBarriers:
    """The store barriers (and store keys) of one ``ParallelState``: numbered in call order under a namespace
    every rank derives alike, so the numbers agree without a module-wide counter and two states in one process
    never share a key."""

    def __init__(self, namespace: str):
        self.namespace = namespace
        self._calls = itertools.count()  # every rank calls its barriers in the same order

    def key(self, name: str) -> str:
        """A fresh store key, the same on every rank that asks at the same point."""
        return f"megatron_domino/{self.namespace}/{next(self._calls)}/{name}"

    def wait(self, name: str, timeout_s: float, *, timeout_key: str | None = None,
             progress: Callable[[str], None] | None = None) -> None:
        """Return once every rank of the default group has called this barrier, or raise ``StoreBarrierTimeout``
        after ``timeout_s`` naming the ranks that did not arrive (``timeout_key``: the setting to raise).

        ``progress`` receives "<name>: k/N ranks arrived" while waiting. A world of one returns at once.
        The last rank to leave deletes the barrier's keys.
        """
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        store, rank, world_size = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
        base = self.key(f"barrier/{name}")
        key = lambda part: f"{base}/{part}"  # noqa: E731
        store.append(key("ranks"), f"{rank},")
        arrived = store.add(key("count"), 1)
        deadline, poll_s = time.monotonic() + timeout_s, 0.01
        while arrived < world_size:
            if progress is not None:
                progress(f"{name}: {arrived}/{world_size} ranks arrived")
            if time.monotonic() >= deadline:
                raise StoreBarrierTimeout(_timeout_message(name, timeout_s, timeout_key, store.get(key("ranks")),
                                                           world_size, rank))
            time.sleep(poll_s)
            poll_s = min(2 * poll_s, _MAX_POLL_S)
            arrived = store.add(key("count"), 0)
        if store.add(key("left"), 1) == world_size:  # everyone has seen the count: nobody reads these keys again
            for part in ("ranks", "count", "left"):
                store.delete_key(key(part))


def _timeout_message(name: str, timeout_s: float, timeout_key: str | None, ranks: bytes, world_size: int,
                     rank: int) -> str:
    arrived = {int(r) for r in ranks.decode().split(",") if r}
    missing = ", ".join(str(r) for r in sorted(set(range(world_size)) - arrived))
    budget = f"{timeout_key} = {timeout_s:g}" if timeout_key else f"{timeout_s:g}s"
    fix = f"; if the phase is slow but healthy, raise {timeout_key}" if timeout_key else ""
    return (f"rank {rank}: store barrier '{name}' timed out ({budget}): {len(arrived)}/{world_size} ranks arrived; "
            f"missing ranks: {missing}. Fix: see those ranks' logs for where they stopped{fix}.")


class Phase:
    """A long stretch of work with its own budget: the watchdog allows it ``budget_s`` without progress
    (instead of ``parallel.timeout_s``), and its barriers wait that long over the store."""

    def __init__(self, name: str, budget_s: float, key: str, barriers: StoreBarriers):
        self.name, self.budget_s, self.key, self.barriers = name, budget_s, key, barriers
        self.detail = "started"

    def progress(self, detail: str) -> None:
        """Record what the phase is doing now; a change counts as progress for the watchdog."""
        self.detail = detail

    def barrier(self, what: str) -> None:
        """Wait, within the budget, for every rank to reach the point named ``what``."""
        self.progress(f"waiting for every rank to reach '{what}'")
        self.barriers.wait(f"{self.name}: {what}", self.budget_s, timeout_key=self.key, progress=self.progress)
        self.progress(f"every rank reached '{what}'")
