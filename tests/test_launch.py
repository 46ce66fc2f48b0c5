"""Launch settings resolved on one CPU process: the CUDA device of a rank (mocked) and the collective timeout."""
import os

import pytest
import torch

from megatron_domino.config import load_config
from megatron_domino.validation import validate_config
from megatron_domino.parallel import launch


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend ``visible`` CUDA devices exist; returns the list of devices set."""
    chosen = []

    def install(visible: int, environment: dict) -> list:
        monkeypatch.setattr(os, "environ", environment)  # the real environment stays untouched
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        return chosen
    return install


def test_torchrun_local_rank_picks_its_gpu(fake_cuda):
    chosen = fake_cuda(8, {"RANK": "13", "WORLD_SIZE": "16", "LOCAL_RANK": "5"})
    assert launch.device_for("nccl") == torch.device("cuda", 5) and chosen == [5]


def test_slurm_task_bound_to_one_gpu_uses_it(fake_cuda):
    environment = {"SLURM_PROCID": "13", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5", "SLURM_JOB_NODELIST": "gpu1"}
    chosen = fake_cuda(1, environment)
    launch._slurm_to_torchrun_env()
    assert launch.device_for("nccl") == torch.device("cuda", 0) and chosen == [0]


def test_no_visible_gpu_is_a_clear_error(fake_cuda):
    chosen = fake_cuda(0, {"LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": ""})
    with pytest.raises(RuntimeError, match="sees no CUDA device.*Fix: "):
        launch.device_for("nccl")
    assert chosen == []


def test_gloo_stays_on_the_cpu_without_asking_cuda(fake_cuda, monkeypatch):
    fake_cuda(8, {"LOCAL_RANK": "5"})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: pytest.fail("torch.cuda asked on the CPU path"))
    assert launch.device_for("gloo") == torch.device("cpu")


def test_collective_timeout_defaults_to_twice_the_watchdog():
    assert launch.collective_timeout_s(load_config(None, ["parallel.timeout_s=60"]).parallel) == 120
    explicit = load_config(None, ["parallel.timeout_s=60", "parallel.collective_timeout_s=500"]).parallel
    assert launch.collective_timeout_s(explicit) == 500
    at_the_limit = load_config(None, ["data.mock=true", "parallel.timeout_s=60", "parallel.collective_timeout_s=120"])
    assert validate_config(at_the_limit, world_size=1, check_paths=False) == []
