"""Starting the default process group from torchrun, slurm's srun, or a bare single process.

The backend and device are chosen here and nowhere else: NCCL + CUDA when CUDA is available,
gloo + CPU otherwise, overridable. Everything downstream only asks for ``device``.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def choose_backend(backend: str = "auto") -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"parallel.backend = {backend!r}: must be auto, nccl or gloo. Fix: use auto.")
    return backend


def device_for(backend: str) -> torch.device:
    """The device of this rank: cuda:LOCAL_RANK under NCCL, the CPU under gloo."""
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(backend: str = "auto", timeout_s: float = 600.0) -> torch.device:
    """Initialise the default group (if not yet) and return this rank's device."""
    _slurm_to_torchrun_env()
    backend = choose_backend(backend)
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a bare `python pretrain_gpt.py`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
        device = device_for(backend)
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if backend == "nccl" else None)
        return device
    return device_for(backend)
