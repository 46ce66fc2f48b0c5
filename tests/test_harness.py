"""The multi-rank harness itself: results come back, failures and hangs fail fast, nothing is left running."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankFailure, run_ranks


def _sum_ranks(rank, world_size):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item(), os.getpid()


def _rank_one_hangs(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    dist.barrier()
    return os.getpid()


def _rank_one_raises(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


def test_results_come_back_from_every_rank():
    results = run_ranks(_sum_ranks, 2)
    assert [r[0] for r in results] == [3.0, 3.0]


@pytest.mark.slow
def test_hanging_rank_fails_within_timeout_and_leaves_nothing(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure, match="timeout"):
        run_ranks(_rank_one_hangs, 2, timeout=8)
    assert time.monotonic() - start < 20
    children = [p for p in os.listdir("/proc") if p.isdigit() and _is_rank_of(int(p))]
    assert children == []


def _is_rank_of(pid):
    """A rank process of this test still alive (child of the forkserver, not the forkserver itself)."""
    if pid == os.getpid() or not _alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().split(")")[-1].split()[1])
    except OSError:
        return False
    if b"forkserver" not in cmd:
        return False
    with open(f"/proc/{ppid}/cmdline", "rb") as f:  # rank processes are forked by the forkserver
        return b"forkserver" in f.read()


def test_failing_rank_reports_its_traceback():
    with pytest.raises(RankFailure, match="deliberate failure on rank 1"):
        run_ranks(_rank_one_raises, 2, timeout=30)
