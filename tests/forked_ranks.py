"""A training run's ranks forked from the tests' preloaded forkserver (tests/harness.py) instead of started by torchrun.

torchrun starts a fresh interpreter per rank, and on 2 cores the ranks' imports of torch and the library (3 s of CPU
each) dominate a tiny run: 8 ranks training 3 steps took 21 s, 2 s of it training. Forked from a server that has
imported both, each rank runs the entry script as ``python pretrain_gpt.py ...`` would (``runpy`` as ``__main__``,
its exit code), with torchrun's rank variables and an env:// rendezvous on ``MASTER_ADDR``/``MASTER_PORT`` (the path
slurm's srun takes). Its stdout and stderr go to files that come back joined in rank order. As under torchrun, the
first rank to fail ends the others, and the run's status is that rank's.

What torchrun's agent adds (its store, in-job restarts, signals to the group) stays tested with torchrun itself:
``training_runs.start`` (killed ranks, signals), tests/test_restart.py and the quick start use it; and
``training_runs.start_ranks`` starts interpreters of their own, as srun does (tests/test_failures.py)."""
from __future__ import annotations

import atexit
import os
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

from megatron_domino.parallel.launch import free_port
from tests.harness import fork_context, stop

GRACE_S = 30  # after a rank fails, what the others get to exit by themselves (torchrun: SIGTERM, then SIGKILL)


def _exit_status(code) -> int:
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)  # sys.exit("message"), as the interpreter prints it
    return 1


def _rank_main(argv: list[str], env: dict, cwd: str, out_path: str, err_path: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, fd)
        os.close(log)
    sys.stdout.reconfigure(line_buffering=True)
    import torch
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # torch was imported before the variable was set
    sys.argv = list(argv)
    status = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        status = _exit_status(exit_.code)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback on stderr, status 1
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()  # what the interpreter runs at exit; os._exit below skips it otherwise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run(argv: list[str], nproc: int, env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """``python *argv`` on ``nproc`` ranks (one: no launcher variables, as a bare process), like torchrun's
    ``--standalone --nproc-per-node=nproc``; raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    context, port = fork_context(), free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        paths = [(os.path.join(logs, f"{rank}.out"), os.path.join(logs, f"{rank}.err")) for rank in range(nproc)]
        procs = []
        for rank in range(nproc):
            rank_env = env if nproc == 1 else dict(
                env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(context.Process(target=_rank_main, args=(argv, rank_env, cwd, *paths[rank])))
            procs[-1].start()
        try:
            status = _wait(procs, time.monotonic() + timeout)
        finally:
            stop(procs)
        stdout, stderr = ("".join(_read(pair[i]) for pair in paths) for i in (0, 1))
    if status is None:
        raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(argv, status, stdout, stderr)


def _wait(procs, deadline: float) -> int | None:
    """The first failing rank's exit status once every rank has ended (0 if none failed); at the deadline, that
    status, or None if no rank failed (a timeout)."""
    failed = None
    while any(p.exitcode is None for p in procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return failed
        wait([p.sentinel for p in procs if p.exitcode is None], timeout=min(remaining, 1.0))
        if failed is None:
            failed = next((p.exitcode for p in procs if p.exitcode not in (None, 0)), None)
            if failed is not None:
                for p in procs:
                    if p.exitcode is None:
                        p.terminate()
                deadline = min(deadline, time.monotonic() + GRACE_S)
    return failed or 0


def _read(path: str) -> str:
    if not os.path.exists(path):  # the rank died before it could open its files
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()
