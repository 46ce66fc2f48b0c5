"""Run a function on N gloo ranks from pytest, with a hard timeout and no processes left behind.

Ranks are forked from a forkserver that has imported torch and the library's heavy modules once, so a start
costs a fork, not a fresh interpreter and a second of imports per rank. The function must be importable (module
level). Each rank returns a value (picklable) or raises; the first failure, or the timeout, kills every rank and
fails the test with that rank's traceback.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback

from megatron_domino.parallel.launch import free_port

_CONTEXT = None


def fork_context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "megatron_domino.training.trainer",
                                         "megatron_domino.training.cli",
                                         "megatron_domino.models.stage_chunks", "megatron_domino.pipeline.engine"])
    return _CONTEXT


def _rank_main(fn, rank, world_size, port, results, args, env):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        from megatron_domino.parallel.strict import install_collective_checks
        install_collective_checks()  # NCCL's device rules at every collective (tests/conftest.py)
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", value))
        if dist.is_initialized():  # trainer.run() and the generation tools end the group themselves
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - any failure is reported to the parent, then the rank dies
        results.put((rank, "error", traceback.format_exc()))


class RankFailure(AssertionError):
    pass


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, env: dict | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results."""
    ctx = fork_context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, results, args, env or {}), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    values, deadline = {}, time.monotonic() + timeout
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankFailure(f"timeout after {timeout:.0f}s: ranks {sorted(set(range(world_size)) - set(values))} "
                                  f"did not finish")
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
                if dead:
                    raise RankFailure(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                      f"and no traceback")
                continue
            if status == "error":
                raise RankFailure(f"rank {rank} failed:\n{value}")
            values[rank] = value
    finally:
        stop(procs)
    return [values[r] for r in range(world_size)]


def stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
