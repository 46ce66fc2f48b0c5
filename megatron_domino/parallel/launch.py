"""Starting the default process group from torchrun, slurm's srun, or a bare single process.

The backend and device are chosen here and nowhere else: NCCL + CUDA when CUDA is available,
gloo + CPU otherwise, overridable. Everything downstream only asks for ``device``. The default group's
store holds this launch attempt's keys alone (``attempt.py``), so a job that torchrun restarts never
reads its dead attempt's. A launch that cannot start as configured raises ``LaunchError``, which the
entry points print as one short block.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from ..config.errors import LaunchError
from ..config.schema import BACKENDS
from .attempt import open_store
from .device import cuda


def _slurm_to_torchrun_env() -> None:
    """Map srun's variables onto torchrun's so one code path serves both launchers."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env:
        return
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in env:
        nodelist = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1"))
        env["MASTER_ADDR"] = _first_slurm_host(nodelist)
    env.setdefault("MASTER_PORT", "29500")


def _first_slurm_host(nodelist: str) -> str:
    """First host of a slurm node list such as 'gpu[003-010,012],cpu1' -> 'gpu003'."""
    head = nodelist.split(",")[0]
    if "[" not in head:
        return head
    prefix, ranges = head.split("[", 1)
    return prefix + ranges.rstrip("]").split(",")[0].split("-")[0]


def launched_world_size() -> int | None:
    """The world size the launcher (torchrun's WORLD_SIZE, slurm's SLURM_NTASKS) announces; None without one.
    The environment is read here and in this module alone."""
    value = os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS")
    return int(value) if value else None


def launched_rank() -> int:
    """This process's rank as the launcher announces it (0 without one), before any process group exists."""
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def choose_backend(backend: str = "auto") -> str:
    if backend == "auto":
        return "nccl" if cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise LaunchError(f"parallel.backend = {backend!r}: must be auto, nccl or gloo. Fix: use auto.")
    return backend


def device_type_for(backend: str) -> str:
    """"cuda" or "cpu": the kind of device the ``parallel.backend`` setting will run on (an invalid setting
    counts as the CPU here; validation names it)."""
    return "cuda" if backend in BACKENDS and choose_backend(backend) == "nccl" else "cpu"


def device_for(backend: str) -> torch.device:
    """The device of this rank: the CPU under gloo; under NCCL cuda:(LOCAL_RANK mod visible devices).

    torchrun shows every GPU of the node (local rank 5 -> cuda:5); slurm's per-task GPU binding shows
    each task only its own (SLURM_LOCALID 5 -> cuda:0).
    """
    if backend != "nccl":
        return torch.device("cpu")
    visible = cuda.device_count()
    if visible == 0:
        raise LaunchError(f"parallel.backend = nccl but this process sees no CUDA device (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). Fix: request GPUs for every task "
                           f"(e.g. srun --gpus-per-task=1), or use parallel.backend=gloo on CPUs.")
    index = int(os.environ.get("LOCAL_RANK", "0")) % visible
    cuda.set_device(index)
    return torch.device("cuda", index)


def collective_timeout_s(parallel) -> float:
    """The process groups' timeout for ``cfg.parallel``: ``collective_timeout_s``, or twice ``timeout_s``.

    At least twice the watchdog's no-progress timeout (validated), so that a hang is reported by the
    watchdog, naming the silent peer, before NCCL aborts the collective. The one place this is resolved.
    """
    return parallel.collective_timeout_s if parallel.collective_timeout_s is not None else 2 * parallel.timeout_s


def shutdown_distributed() -> None:
    """The end of a run that went well: every rank waits for the others, then the default group is torn down
    while the interpreter is still whole. Left to the interpreter's exit, gloo's worker thread may still be
    freeing a finished collective (all_gather_object's tensors hold Python objects): the free takes the GIL,
    a finalizing interpreter ends the thread inside that noexcept destructor, and the rank dies with SIGABRT,
    "terminate called without an active exception" (seen in a core dump of a benchmark's last rank, about one
    run in four). NCCL warns, too, when its group is never destroyed."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def init_distributed(backend: str = "auto", timeout_s: float = 1200.0) -> torch.device:
    """Initialise the default group (if not yet) and return this rank's device.

    ``timeout_s`` is the collective timeout: pass ``collective_timeout_s(cfg.parallel)``.
    """
    _slurm_to_torchrun_env()
    backend = choose_backend(backend)
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a bare `python pretrain_gpt.py`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
        device = device_for(backend)
        timeout = datetime.timedelta(seconds=timeout_s)
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend=backend, store=open_store(rank, world_size, timeout), rank=rank,
                                world_size=world_size, timeout=timeout, device_id=device if backend == "nccl" else None)
        return device
    return device_for(backend)
