"""A per-rank watchdog: a hang becomes a report and an exit, never silence.

A background thread publishes this rank's heartbeat in the launcher's key-value store and
polls what the rank is doing (``describe()``: the step, the phase and the pipeline
instruction). When that has not changed for ``timeout_s``, it prints once, prefixed with the
rank's coordinates, what it was waiting in and which peers stopped beating (a dead peer's
coordinates), then ends the process with a non-zero status. Every rank runs one, so every
rank of a broken job exits within the timeout.
"""
from __future__ import annotations

import os
import sys
import threading
import time

import torch.distributed as dist

EXIT_CODE = 3
_KEY = "megatron_domino/heartbeat/{}"


class Watchdog:
    def __init__(self, state, timeout_s: float, describe, interval_s: float = 1.0):
        self.state, self.timeout_s, self.describe, self.interval_s = state, timeout_s, describe, interval_s
        self._store = _default_store()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megatron-domino-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last, since = None, time.monotonic()
        while not self._stop.wait(self.interval_s):
            self._beat()
            now, current = time.monotonic(), self.describe()
            if current != last:
                last, since = current, now
            elif now - since > self.timeout_s:
                self._report(current, now - since)
                os._exit(EXIT_CODE)

    def _beat(self) -> None:
        if self._store is not None:
            try:
                self._store.set(_KEY.format(self.state.rank), repr(time.time()))
            except Exception:  # noqa: BLE001 - a store outage must not kill a healthy rank
                pass

    def silent_peers(self, wait_s: float = 0.0) -> list[int]:
        """Ranks whose heartbeat is older than a few intervals (dead or frozen), longest silent first.

        Right after a peer dies its last heartbeat is still fresh: ``wait_s`` gives it time to go stale.
        The first one named is usually the cause; the others stopped when they lost it.
        """
        if self._store is None:
            return []
        deadline = time.monotonic() + wait_s
        while True:
            stale, now = [], time.time()
            for rank in range(self.state.topology.world_size):
                if rank == self.state.rank:
                    continue
                try:
                    beat = float(self._store.get(_KEY.format(rank)).decode())
                except Exception:  # noqa: BLE001 - no heartbeat (or no store any more) counts as silent
                    beat = 0.0
                if now - beat > 5 * self.interval_s:
                    stale.append((beat, rank))
            if stale or time.monotonic() >= deadline:
                return [rank for _, rank in sorted(stale)]
            time.sleep(self.interval_s)

    def describe_silent_peers(self, wait_s: float = 0.0) -> str:
        topology = self.state.topology
        peers = ", ".join(f"rank {r} (tp {c.tp}, pp {c.pp}, dp {c.dp})"
                          for r, c in ((r, topology.coordinate(r)) for r in self.silent_peers(wait_s)))
        return f"silent peers, longest silent first: {peers or 'none seen'}"

    def _report(self, current: str, stuck_s: float) -> None:
        print(f"[{self.state.coordinates()}] watchdog: no progress for {stuck_s:.0f}s "
              f"(parallel.timeout_s = {self.timeout_s:g}) while in: {current}; {self.describe_silent_peers()}. "
              f"Exiting with status {EXIT_CODE}.", file=sys.stderr, flush=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s)


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (a world of one without rendezvous): heartbeats are skipped
        return None
