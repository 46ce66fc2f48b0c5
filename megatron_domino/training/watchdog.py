"""A per-rank watchdog: a hang becomes a report and an exit, never silence.

A background thread publishes this rank's heartbeat in the launcher's key-value store and
polls what the rank is doing (``describe()``: the step, the phase and the pipeline
instruction). When that has not changed for ``timeout_s``, it prints once, prefixed with the
rank's coordinates, what it was waiting in and which peers stopped beating (a dead peer's
coordinates), then ends the process with a non-zero status. Every rank runs one, so every
rank of a broken job exits within the timeout.

Long phases (index build, checkpoint save and load) run under ``watching(phase)``: there the limit
is the phase's budget (``data.index_build_timeout_s``, ``checkpoint.save_timeout_s``, ...) and the
phase's progress counts as progress, so a slow but healthy phase is not taken for a hang while a
stuck one is still named, with its budget. The watchdog gives a phase a few intervals beyond its
budget so that a barrier inside it, which waits exactly the budget, reports first: its error names
the ranks that did not arrive. A dead peer does not get the budget: after ``timeout_s`` without
progress in a phase, the watchdog looks (every tenth of ``timeout_s``) for peers silent for over
half of ``timeout_s`` and reports them, before any collective in the phase could time out.
``parallel.timeout_s`` must stay below the collective timeout (``parallel.collective_timeout_s``,
at least twice as long) so that these reports, not NCCL's abort, come first.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

import torch.distributed as dist

from ..config.errors import KnownError

EXIT_CODE = 3
_KEY = "megatron_domino/heartbeat/{}"


class Watchdog:
    """``store`` defaults to the default group's; ``exit_process`` is replaceable so tests can watch it fire."""

    def __init__(self, state, timeout_s: float, describe, interval_s: float = 1.0, store=None,
                 exit_process=os._exit):
        self.state, self.timeout_s, self.describe, self.interval_s = state, timeout_s, describe, interval_s
        self._store = store if store is not None else _default_store()
        self._exit_process = exit_process
        self._phase = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megatron-domino-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def watching(self, phase):
        """Apply ``phase``'s budget (a ``parallel.store_barrier.Phase``) instead of the timeout while inside."""
        self._phase = phase
        try:
            yield phase
        finally:
            self._phase = None

    def _run(self) -> None:
        last, since, next_peer_check = None, time.monotonic(), 0.0
        while not self._stop.wait(self.interval_s):
            self._beat()
            phase = self._phase
            now, current = time.monotonic(), self.describe()
            if phase is not None:
                current = f"{current}; {phase.name}: {phase.detail}"
            if current != last:
                last, since = current, now
                continue
            stuck = now - since
            if phase is None:
                hung = stuck > self.timeout_s
            elif stuck > phase.budget_s + 5 * self.interval_s:
                hung = True
            elif stuck > self.timeout_s and now >= next_peer_check:  # a phase waiting on a dead peer
                next_peer_check = now + self.timeout_s / 10
                hung = bool(self.silent_peers(stale_s=self.timeout_s / 2))
            else:
                hung = False
            if hung:
                self._report(current, stuck, phase)
                self._exit_process(EXIT_CODE)
                return

    def _beat(self) -> None:
        if self._store is not None:
            try:
                self._store.set(_KEY.format(self.state.rank), repr(time.time()))
            except Exception:  # noqa: BLE001 - a store outage must not kill a healthy rank
                pass

    def silent_peers(self, wait_s: float = 0.0, stale_s: float | None = None) -> list[int]:
        """Ranks whose heartbeat is older than ``stale_s`` (default: a few intervals; dead or frozen),
        longest silent first.

        Right after a peer dies its last heartbeat is still fresh: ``wait_s`` gives it time to go stale.
        The first one named is usually the cause; the others stopped when they lost it.
        """
        stale_s = 5 * self.interval_s if stale_s is None else stale_s
        if self._store is None:
            return []
        deadline = time.monotonic() + wait_s
        while True:
            stale, now = [], time.time()
            for rank in range(self.state.topology.world_size):
                if rank == self.state.rank:
                    continue
                key = _KEY.format(rank)
                try:  # check first: get() on a missing key blocks for the store's (collective) timeout
                    beat = float(self._store.get(key).decode()) if self._store.check([key]) else 0.0
                except Exception:  # noqa: BLE001 - no heartbeat (or no store any more) counts as silent
                    beat = 0.0
                if now - beat > stale_s:
                    stale.append((beat, rank))
            if stale or time.monotonic() >= deadline:
                return [rank for _, rank in sorted(stale)]
            time.sleep(self.interval_s)

    def describe_silent_peers(self, wait_s: float = 0.0) -> str:
        topology = self.state.topology
        peers = ", ".join(f"rank {r} (tp {c.tp}, pp {c.pp}, dp {c.dp})"
                          for r, c in ((r, topology.coordinate(r)) for r in self.silent_peers(wait_s)))
        return f"silent peers, longest silent first: {peers or 'none seen'}"

    def _report(self, current: str, stuck_s: float, phase) -> None:
        limit = (f"parallel.timeout_s = {self.timeout_s:g}" if phase is None
                 else f"phase '{phase.name}', budget {phase.key} = {phase.budget_s:g}")
        print(f"[{self.state.coordinates()}] watchdog: no progress for {stuck_s:.0f}s ({limit}) while in: {current}; "
              f"{self.describe_silent_peers()}. Exiting with status {EXIT_CODE}.", file=sys.stderr, flush=True)

    def report_failure(self, error: BaseException) -> None:
        """Stop watching, then print one line naming what this rank was doing (``describe``) and which peers
        went silent (a dead peer's coordinates), for errors that do not say where themselves (a known error's
        message does). Never raises: the state it describes may be what is broken (a step read from damaged
        checkpoint metadata)."""
        self.close()
        if isinstance(error, (KnownError, KeyboardInterrupt)):
            return
        try:
            doing = f"{self.describe()}; {self.describe_silent_peers(wait_s=5 * self.interval_s)}"
        except Exception as problem:  # noqa: BLE001
            doing = f"a state that cannot be described ({type(problem).__name__}: {problem})"
        print(f"[{self.state.coordinates()}] failed while in: {doing}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s)


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (a world of one without rendezvous): heartbeats are skipped
        return None
