"""Which attempt of a job this process belongs to, and a store namespace that is this attempt's alone.

A job may start its ranks more than once: torchrun restarts every worker after one fails (``--max-restarts``),
and slurm requeues a job (``--requeue``). Two things depend on knowing it:

- The store. torchrun (torch >= 2.5, c10d or static rendezvous) lends the workers its own TCPStore
  (``TORCHELASTIC_USE_AGENT_STORE=True``) and keeps it across restarts, so a new attempt finds the old one's
  keys: gloo and NCCL read the dead ranks' addresses there and fail ("Gloo connectFullMesh failed ...
  Connection refused"; pytorch#135712, #167288). Every group torch creates keeps its keys under the default
  group's store, so one prefix on that store isolates all of them (ours, torch's, the checkpoints' gloo group,
  the store barriers and heartbeats). The prefix cannot come from ``TORCHELASTIC_RESTART_COUNT``: each node's
  agent counts its own restarts, and the counts differ between nodes (pytorch#108158, #135712). Instead
  rank 0 draws the next number from a counter in the store and hands it to each rank in reply to a random token
  that rank posted: a reply under a key nobody could know before can never be stale.
- The identity. An attempt after the first resumes from ``latest`` by itself, and takes over the lock on
  checkpoint.dir left by its dead predecessor, when both belong to one job (``training/checkpoint_dir.py``).
"""
from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

from ..config.errors import LaunchError

_ROOT = "megatron_domino/attempts"  # outside every attempt's namespace: survives the restarts
_MAX_POLL_S = 0.05


@dataclass(frozen=True)
class Attempt:
    """``job``: the same in every attempt of one job (slurm's job id, or a token kept in torchrun's store); None
    where the launcher names no job. ``requeues``: slurm's restarts of the job; ``restarts``: torchrun's."""

    job: str | None = None
    requeues: int = 0
    restarts: int = 0

    @property
    def number(self) -> int:
        """0 for the job's first attempt, k for its k-th restart (requeues and in-job restarts together)."""
        return self.requeues + self.restarts

    @property
    def order(self) -> list[int]:
        """Compares greater for a later attempt of the same job."""
        return [self.requeues, self.restarts]

    def describe(self) -> str:
        parts = [f"{what} {count}" for what, count in (("slurm requeue", self.requeues),
                                                        ("torchrun restart", self.restarts)) if count]
        return ", ".join(parts) or "first attempt"


_current = Attempt()
_agreed = False  # an earlier init_process_group of this process found ``_current`` (a re-init is no restart)


def current_attempt() -> Attempt:
    """The attempt that ``open_store`` found for this process (the first attempt if it never ran)."""
    return _current


def _uses_agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _attempt_here(restarts: int, token: str | None) -> Attempt:
    """Rank 0's view of the attempt; every other rank receives it, so all agree even where the environment
    differs between nodes. ``restarts``/``token``: what the shared store's counter said (None: no shared store)."""
    env = os.environ
    if token is None:  # a store of this attempt alone (torch <= 2.4, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
        restarts = int(env.get("TORCHELASTIC_RESTART_COUNT") or 0)
        run_id = env.get("TORCHELASTIC_RUN_ID")
        token = f"torchelastic:{run_id}" if run_id and run_id != "none" else None
    else:
        token = f"torchrun:{token}"
    if env.get("SLURM_JOB_ID"):
        token = f"slurm:{env.get('SLURM_CLUSTER_NAME', '')}:{env['SLURM_JOB_ID']}"
    return Attempt(token, int(env.get("SLURM_RESTART_COUNT") or 0), restarts)


def open_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The store for ``init_process_group``, with keys of this attempt only; records ``current_attempt``."""
    global _current, _agreed
    if _uses_agent_store():
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=timeout)
        generation, _current = _agree(client, rank, world_size, timeout.total_seconds(), _current if _agreed else None)
        _agreed = True
        return dist.PrefixStore(f"megatron_domino/attempt-{generation}", client)
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore("default_pg", store)  # as init_process_group names it; this store is new
    key = "megatron_domino/attempt"
    if rank == 0:
        store.set(key, json.dumps(asdict(_attempt_here(0, None))))
    _current = Attempt(**json.loads(store.get(key)))
    return store


def _agree(store, rank: int, world_size: int, timeout_s: float, known: Attempt | None) -> tuple[int, Attempt]:
    """Every rank's (generation, attempt) from rank 0, over a store that may hold earlier attempts' keys. Every
    call opens a new generation (a fresh namespace); ``known``: rank 0's attempt, found by an earlier call."""
    hello = f"{_ROOT}/hello"
    if rank != 0:
        token = secrets.token_hex(8)
        reply = f"{_ROOT}/reply/{token}"
        store.append(hello, token + ",")
        try:
            store.wait([reply], timedelta(seconds=timeout_s))
        except Exception as problem:  # noqa: BLE001 - the store's timeout error differs between torch versions
            raise LaunchError(
                f"rank {rank}: rank 0 did not hand out this attempt's store namespace within {timeout_s:g}s "
                f"({type(problem).__name__}). Fix: see rank 0's log for why it did not start; if start-up is "
                f"slow but healthy, raise parallel.collective_timeout_s") from None
        generation, attempt = _decode(store.get(reply))
        store.append(f"{_ROOT}/{generation}/ranks", f"{rank},")
        store.add(f"{_ROOT}/{generation}/joined", 1)
        return generation, attempt
    generation = store.add(f"{_ROOT}/generation", 1)
    token = store.compare_set(f"{_ROOT}/job", "", secrets.token_hex(8)).decode()
    attempt = known or _attempt_here(generation - 1, token)
    _answer_every_rank(store, generation, json.dumps([generation, asdict(attempt)]), world_size, timeout_s)
    return generation, attempt


def _decode(value: bytes) -> tuple[int, Attempt]:
    generation, fields = json.loads(value)
    return generation, Attempt(**fields)


def _answer_every_rank(store, generation: int, record: str, world_size: int, timeout_s: float) -> None:
    """Rank 0: reply to every token posted (stale ones included: nobody reads those) until all ranks joined."""
    hello, joined = f"{_ROOT}/hello", f"{_ROOT}/{generation}/joined"
    replied, deadline, poll_s = [], time.monotonic() + timeout_s, 0.001
    while store.add(joined, 0) < world_size - 1:
        if store.check([hello]):
            for token in store.get(hello).decode().split(","):
                if token and token not in replied:
                    store.set(f"{_ROOT}/reply/{token}", record)
                    replied.append(token)
        if time.monotonic() > deadline:
            came = store.get(f"{_ROOT}/{generation}/ranks").decode() if store.check(
                [f"{_ROOT}/{generation}/ranks"]) else ""
            missing = sorted(set(range(1, world_size)) - {int(r) for r in came.split(",") if r})
            raise LaunchError(f"rank 0: ranks {missing} did not join attempt {generation} of this job within "
                              f"{timeout_s:g}s. Fix: see those ranks' logs for why they did not start; if start-up "
                              f"is slow but healthy, raise parallel.collective_timeout_s")
        time.sleep(poll_s)
        poll_s = min(2 * poll_s, _MAX_POLL_S)
    # Every rank of this attempt has read its reply: nobody reads these keys again.
    for token in replied:
        store.delete_key(f"{_ROOT}/reply/{token}")
    store.delete_key(hello)
