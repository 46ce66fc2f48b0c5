"""fp8/probed_kernel.py: a kernel's probe runs once per CUDA device, a failed one warns once, and ``assumed``
answers without probing, then restores what was known."""
import warnings

import pytest
import torch

from megatron_domino.fp8 import probed_kernel
from megatron_domino.fp8.probed_kernel import ProbedKernel


def test_the_probe_runs_once_per_device_and_a_failure_warns_once(monkeypatch):
    monkeypatch.setattr(probed_kernel.cuda, "get_device_name", lambda device: f"GPU {device.index}")
    probed = []
    kernel = ProbedKernel(lambda device: probed.append(device.index) or device.index == 0, "the loop runs")
    assert not kernel.works(torch.device("cpu")) and probed == []  # never a CPU kernel, never probed
    assert kernel.works(torch.device("cuda", 0)) and kernel.works(torch.device("cuda", 0))
    with pytest.warns(UserWarning, match=r"GPU 1 \(torch .*\): the loop runs"):
        assert not kernel.works(torch.device("cuda", 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not kernel.works(torch.device("cuda", 1))
    assert probed == [0, 1]


def test_assumed_answers_without_a_probe_and_restores_the_verdicts():
    probed = []
    kernel = ProbedKernel(lambda device: probed.append(device.index) or True, "the loop runs")
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert kernel.works(cuda0)
    with kernel.assumed(False, [cuda0, cuda1]):
        assert not kernel.works(cuda0) and not kernel.works(cuda1)
    assert kernel.works(cuda0) and probed == [0]
    with kernel.assumed(True, [cuda1]):
        assert kernel.works(cuda1)
    assert kernel.works(cuda1) and probed == [0, 1]  # learnt now, not kept from the assumption
