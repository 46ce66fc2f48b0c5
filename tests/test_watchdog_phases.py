"""Timeouts by phase: the watchdog gives a long phase its budget, the store barrier names who did not come,
and the preemption flag is agreed one step late without a blocking sync."""
import signal
import time

import pytest
import torch
import torch.distributed as dist

from megatron_domino.parallel import Topology
from megatron_domino.parallel.store_barrier import Phase, StoreBarriers, StoreBarrierTimeout
from megatron_domino.training.signals import PreemptionHandler
from megatron_domino.training.watchdog import EXIT_CODE, Watchdog
from tests.harness import run_ranks


class _State:
    """One rank of two (dp 2)."""
    topology = Topology(2)

    def __init__(self, rank: int):
        self.rank = rank

    def coordinates(self) -> str:
        return f"rank {self.rank} (tp 0, pp 0, dp {self.rank})"


def _watchdog(timeout_s: float, exits: list, store=None) -> Watchdog:
    """Rank 0's watchdog. Without a ``store`` given, rank 1 stopped beating an hour ago (dead)."""
    if store is None:
        store = dist.HashStore()
        store.set("megatron_domino/heartbeat/1", repr(time.time() - 3600))
    return Watchdog(_State(0), timeout_s, lambda: "step 1: saving a checkpoint", interval_s=0.2, store=store,
                    exit_process=exits.append)


def _wait_for(exits: list, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.slow
def test_a_phase_longer_than_the_timeout_but_within_its_budget_does_not_trip(capsys):
    exits, store = [], dist.HashStore()
    live_peer = Watchdog(_State(1), 60.0, lambda: "rank 1 writing", interval_s=0.2, store=store,
                         exit_process=exits.append)
    watchdog = _watchdog(2.0, exits, store)
    try:
        phase = Phase("checkpoint save", 5.0, "checkpoint.save_timeout_s", StoreBarriers("test"))
        with watchdog.watching(phase):  # 6 s in all, 3 s at a time without progress: over 2 s, within 5 s
            time.sleep(3.0)
            phase.progress("writing model-pp000.safetensors")
            time.sleep(3.0)
        assert exits == [], capsys.readouterr().err
        _wait_for(exits, 5.0)  # outside the phase, parallel.timeout_s applies again
    finally:
        watchdog.close()
        live_peer.close()
    assert exits == [EXIT_CODE]
    assert "(parallel.timeout_s = 2)" in capsys.readouterr().err


def test_a_phase_over_its_budget_is_reported_naming_the_phase_and_the_silent_peer(capsys):
    exits = []
    watchdog = _watchdog(60.0, exits)
    try:
        with watchdog.watching(Phase("index build", 1.0, "data.index_build_timeout_s", StoreBarriers("test"))):
            _wait_for(exits, 10.0)
    finally:
        watchdog.close()
    report = capsys.readouterr().err
    assert exits == [EXIT_CODE], report
    assert "phase 'index build', budget data.index_build_timeout_s = 1" in report
    assert "while in: step 1: saving a checkpoint; index build: started" in report
    assert "silent peers, longest silent first: rank 1 (tp 0, pp 0, dp 1)" in report


def test_a_dead_peer_in_a_phase_is_reported_within_the_timeout_not_the_budget(capsys):
    exits = []
    watchdog = _watchdog(1.0, exits)
    started = time.monotonic()
    try:
        with watchdog.watching(Phase("checkpoint save", 60.0, "checkpoint.save_timeout_s", StoreBarriers("test"))):
            _wait_for(exits, 10.0)
    finally:
        watchdog.close()
    report = capsys.readouterr().err
    assert exits == [EXIT_CODE] and time.monotonic() - started < 5, report
    assert "phase 'checkpoint save'" in report and "rank 1 (tp 0, pp 0, dp 1)" in report


def _phase_checks(rank, world_size):
    """Three checks in one spawn: barriers complete and clean up; the preemption flag; a barrier timeout."""
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    keys_before = store.num_keys()
    dist.barrier()
    seen, barriers, other_state_barriers = [], StoreBarriers("test"), StoreBarriers("other")
    time.sleep(0.3 * rank)  # ranks arrive one by one: rank 0 watches the count rise
    barriers.wait("staggered", 30.0, progress=seen.append)
    other_state_barriers.wait("staggered", 30.0)  # a second state's barrier of the same name keeps its own keys
    barriers.wait("again", 30.0)
    dist.barrier()  # the last rank out of each barrier has deleted its keys before getting here
    keys_left = store.num_keys() - keys_before

    handler = PreemptionHandler(torch.device("cpu"))
    decisions = []
    for step in range(5):
        if step == 1 and rank == 1:
            signal.raise_signal(signal.SIGUSR1)
        decisions.append(handler.should_stop())
        if decisions[-1]:
            break
    handler.close()

    error = None
    if rank != world_size - 1:  # the last rank never comes
        try:
            barriers.wait("files written", 1.5, timeout_key="checkpoint.save_timeout_s")
        except StoreBarrierTimeout as err:
            error = str(err)
    return seen, keys_left, decisions, error


def test_store_barrier_and_preemption_flag_on_three_ranks():
    results = run_ranks(_phase_checks, 3, timeout=90)
    seen = results[0][0]
    assert seen and seen[0] == "staggered: 1/3 ranks arrived" and "staggered: 2/3 ranks arrived" in seen, seen
    assert [r[1] for r in results] == [0, 0, 0]  # no keys left behind
    assert all(r[2] == [False, False, True] for r in results), results  # one step after rank 1's signal, everywhere
    for rank in (0, 1):
        message = results[rank][3]
        assert message is not None and "store barrier 'files written' timed out" in message, message
        assert "checkpoint.save_timeout_s = 1.5" in message and "2/3 ranks arrived" in message
        assert "missing ranks: 2." in message and f"rank {rank}:" in message
    assert results[2][3] is None
