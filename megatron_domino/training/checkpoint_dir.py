"""A run's output folders, made ready on rank 0 before the model is built, so that no step is computed for a
checkpoint that could never be written.

Rank 0, in this order:
- creates ``log.dir`` and ``checkpoint.dir`` and writes a probe file into each: a read-only or otherwise
  unwritable folder fails now, not at the first save;
- takes the lock ``<checkpoint.dir>/.lock`` (JSON: host, pid, start time, run id, job and attempt), so a second
  run into the same folder is refused, naming the first. Its mtime is a heartbeat, touched every ``HEARTBEAT_S``
  by a daemon thread. A lock is stale, and is taken over with a warning, when it was taken by an earlier attempt
  of this job (``parallel/attempt.py``: torchrun starts, and slurm requeues, an attempt only once the previous
  one has ended) whose pid is not alive here, when its pid is dead on this host, or when its heartbeat is older
  than ``STALE_AFTER_S`` (a run on another host, whose death this host cannot see);
- resumes from ``latest`` when this is a restarted attempt of the job that last accepted the folder (named in
  ``<checkpoint.dir>/.job``), whatever ``checkpoint.load`` says; otherwise refuses a fresh start into a folder
  that holds checkpoints (a ``latest``) unless ``checkpoint.load`` says what to do, since the new run would
  publish over them. A restart never takes over another job's checkpoints;
- removes ``.tmp-*`` folders: under the lock no live run writes there, so they are interrupted saves' leftovers;
- compares the free space with one checkpoint's estimated size; a shortfall warns or fails
  (``checkpoint.free_space``).
The verdict travels to the other ranks over the launcher's store, so every rank raises the same error (the
reporter prints it once) or receives the run id that makes this run's temporary folders its own, and whether
to resume from ``latest``.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import threading
import time
import warnings
from typing import NamedTuple

import torch.distributed as dist

from .. import checkpoint_format as fmt
from ..config.errors import CheckpointError
from ..parallel.attempt import Attempt

LOCK = ".lock"
JOB = ".job"  # the job that last accepted the folder: its restarts resume here by themselves
HEARTBEAT_S = 60.0
STALE_AFTER_S = 900.0  # 15 heartbeats missed: the holder is gone even if its pid cannot be checked from here
RUN_DIRS_VERDICT = "run dirs verdict"  # the name of rank 0's store key in ``prepare_run_dirs``


class DirLock:
    """This run's hold on a checkpoint folder; ``release`` (or the process's end, which stops the heartbeat)
    lets it go."""

    def __init__(self, path: str, run_id: str):
        self.path, self.run_id = path, run_id
        self._stop = threading.Event()
        threading.Thread(target=self._beat, name="checkpoint-dir-lock", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        if (_read_json(self.path) or {}).get("run_id") == self.run_id:  # never remove a lock taken over since
            try:
                os.remove(self.path)
            except OSError:  # the folder went away: nothing left to hold
                pass


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else None
    except (OSError, ValueError):
        return None


def _describe(holder: dict | None) -> str:
    if holder is None:
        return "an unknown run (its lock file is unreadable)"
    return f"the run of pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


def _pid_alive_here(holder: dict | None) -> bool | None:
    """Whether the holder's pid runs on this host (None: it cannot be told from here)."""
    if not (holder and holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int)):
        return None
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _stale_reason(path: str, holder: dict | None, attempt: Attempt) -> str | None:
    """Why the lock at ``path`` no longer holds (None: it does)."""
    alive = _pid_alive_here(holder)
    if (holder and attempt.job is not None and holder.get("job") == attempt.job and alive is not True
            and isinstance(holder.get("attempt"), list) and holder["attempt"] < attempt.order):
        return (f"it was taken by an earlier attempt of this job ({attempt.job}), which has ended; this is "
                f"restart attempt {attempt.number}")
    if alive is False:
        return f"its process {holder['pid']} is no longer running"
    try:
        age = time.time() - os.path.getmtime(path)
    except FileNotFoundError:
        return "it was released meanwhile"
    return f"no heartbeat for {age / 60:.0f} min" if age > STALE_AFTER_S else None


def acquire_lock(root: str, run_id: str, attempt: Attempt = Attempt()) -> DirLock:
    """Take ``root``'s lock, taking over a stale one with a warning; a live holder is refused by name."""
    path = os.path.join(root, LOCK)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id,
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "job": attempt.job, "attempt": attempt.order}
    for tries in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_json(path)
            reason = _stale_reason(path, holder, attempt) if tries == 0 else None
            if reason is None:
                raise CheckpointError(
                    f"checkpoint.dir = {root!r} is in use by {_describe(holder)} (lock {path}); two runs into one "
                    f"folder would overwrite each other's checkpoints. Fix: give this run another checkpoint.dir, "
                    f"or wait for that run to end; if it is dead, delete {path}") from None
            warnings.warn(f"checkpoint.dir = {root!r}: taking over the lock of {_describe(holder)}: {reason}",
                          stacklevel=2)
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        return DirLock(path, run_id)
    raise AssertionError("unreachable: the second attempt returns or raises")


def probe(key: str, path: str) -> None:
    """Create ``path`` and write, fsync and remove a file there; an unwritable folder is a CheckpointError."""
    try:
        os.makedirs(path, exist_ok=True)
        probe_file = os.path.join(path, f".probe-{socket.gethostname()}-{os.getpid()}")
        with open(probe_file, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe_file)
    except OSError as problem:
        raise CheckpointError(f"{key} = {path!r} is not writable ({problem.strerror}: {problem.filename}), found "
                              f"before step 1. Fix: make it writable, or point {key} at a writable folder") from None


def _refuse_fresh_start_over(root: str, load: str | None) -> None:
    if load is None and os.path.exists(os.path.join(root, fmt.LATEST)):
        raise CheckpointError(
            f"checkpoint.dir = {root!r} already holds checkpoints (a '{fmt.LATEST}' file) and checkpoint.load is "
            f"not set: a fresh start would publish over them. Fix: checkpoint.load=auto to resume from them, "
            f"checkpoint.load=PATH to start from another checkpoint, or a new checkpoint.dir")


def _remove_leftovers(root: str) -> None:
    for name in sorted(os.listdir(root)):
        if name.startswith(fmt.TMP_PREFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            warnings.warn(f"removed {os.path.join(root, name)}, left by an interrupted save", stacklevel=2)


def _check_free_space(cfg) -> None:
    root, need = cfg.checkpoint.dir, fmt.estimated_bytes(cfg)
    free = shutil.disk_usage(root).free
    if free >= need:
        return
    message = (f"checkpoint.dir = {root!r} has {free / 2**30:.2f} GiB free, less than one checkpoint "
               f"(about {need / 2**30:.2f} GiB: parameters and optimizer state). Fix: free space, or point "
               f"checkpoint.dir at a larger disk")
    if cfg.checkpoint.free_space == "fail":
        raise CheckpointError(message + " (checkpoint.free_space=warn only warns)")
    warnings.warn(message, stacklevel=2)


def _resumes(root: str, attempt: Attempt) -> bool:
    """Whether this restarted attempt resumes from ``latest``: only where its own job accepted the folder."""
    if attempt.number == 0 or attempt.job is None or not os.path.exists(os.path.join(root, fmt.LATEST)):
        return False
    return (_read_json(os.path.join(root, JOB)) or {}).get("job") == attempt.job


def _mark_job(root: str, attempt: Attempt) -> None:
    """Name the job that accepted the folder (no job: forget the previous one, whose restarts are over)."""
    path = os.path.join(root, JOB)
    if attempt.job is None:
        if os.path.exists(path):
            os.remove(path)
        return
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"job": attempt.job, "attempt": attempt.order}, f)
    os.replace(path + ".tmp", path)


def _prepare_here(cfg, writes_checkpoints: bool, run_id: str, attempt: Attempt) -> tuple[DirLock | None, bool]:
    """Rank 0's part: everything above, in that order; on an error nothing is left locked. Returns the lock and
    whether to resume from ``latest``."""
    probe("log.dir", cfg.log.dir)
    root = cfg.checkpoint.dir
    if not (writes_checkpoints and root):
        return None, False
    probe("checkpoint.dir", root)
    lock = acquire_lock(root, run_id, attempt)
    try:
        resume = _resumes(root, attempt)
        if not resume:
            _refuse_fresh_start_over(root, cfg.checkpoint.load)
        _remove_leftovers(root)
        _check_free_space(cfg)
        _mark_job(root, attempt)  # accepted: this job's restarts may resume here
    except BaseException:
        lock.release()
        raise
    return lock, resume


class RunDirs(NamedTuple):
    run_id: str  # the same on every rank: names this run's temporary folders
    lock: DirLock | None  # rank 0's, to release at the end
    resume: bool  # a restarted attempt: load ``latest`` of checkpoint.dir, whatever checkpoint.load says


def prepare_run_dirs(cfg, rank: int, key: str, writes_checkpoints: bool = True,
                     attempt: Attempt = Attempt()) -> RunDirs:
    """Make the run's folders ready (collective over every rank of the default group). ``key``: the store key
    of rank 0's verdict, the same on every rank (``StoreBarriers.key(RUN_DIRS_VERDICT)``); ``attempt``: this
    launch attempt (``parallel.attempt.current_attempt()``)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    store = dist.distributed_c10d._get_default_store() if world > 1 else None
    if rank != 0:
        verdict = json.loads(store.get(key))
        if verdict["error"]:
            raise CheckpointError(verdict["error"])
        return RunDirs(verdict["run_id"], None, verdict.get("resume", False))
    run_id = secrets.token_hex(4)
    try:
        lock, resume = _prepare_here(cfg, writes_checkpoints, run_id, attempt)
    except Exception as error:  # the other ranks wait for a verdict: they get this one and stop too
        if store is not None:
            store.set(key, json.dumps({"run_id": run_id, "error": str(error)}))
        raise
    if store is not None:
        store.set(key, json.dumps({"run_id": run_id, "error": None, "resume": resume}))
    return RunDirs(run_id, lock, resume)
