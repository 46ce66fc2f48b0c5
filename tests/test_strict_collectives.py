"""Collectives on the right device (NCCL groups take device tensors only), checked on gloo by the strict mode.

On CPU every tensor is a host tensor, so the strict mode marks the library's host copies (``to_host``) and
refuses them at every collective; the checkpoint path must join shards on the device and copy afterwards."""
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_domino.models.full_state import gather_full
from megatron_domino.parallel import ParallelState, Topology
from megatron_domino.parallel.strict import HostCopy, check_collective, to_host
from megatron_domino.tensor_parallel.sharding import ParamInfo, ShardSpec
from tests.harness import run_ranks

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_domino")


def _checks(rank, world_size):
    ps = ParallelState(Topology(world_size, 2, 1, 1), strict=True)  # installs the checks
    param = torch.nn.Parameter(torch.full((2, 3), float(rank)))
    full = gather_full(param, ParamInfo(ShardSpec(dim=0, parts=(4,))), ps.tp_group)  # device gather, then host
    outcomes = {"gathered": full.tolist(), "is_host_copy": isinstance(full, HostCopy)}
    try:  # the order the checkpoint used before: to the host first, then the collective
        dist.all_gather([torch.empty(2, 3) for _ in range(2)], to_host(param), group=ps.tp_group)
    except RuntimeError as error:
        outcomes["host_first"] = str(error)
    try:
        check_collective("all_reduce", (torch.empty(2, device="meta"),), {"group": ps.tp_group})
    except RuntimeError as error:
        outcomes["wrong_device"] = str(error)
    flag = torch.ones(1)
    dist.all_reduce(flag, group=ps.tp_group)  # a device tensor passes
    outcomes["sum"] = flag.item()
    ps.destroy()
    return outcomes


def test_host_copies_are_refused_by_collectives_and_device_tensors_pass():
    for outcome in run_ranks(_checks, 2, timeout=60):
        assert outcome["gathered"] == [[0.0] * 3] * 2 + [[1.0] * 3] * 2 and outcome["is_host_copy"]
        assert "host copy" in outcome["host_first"] and "no backend for device type cpu" in outcome["host_first"]
        assert "meta tensor on a group that serves ['cpu', 'cuda']" in outcome["wrong_device"]
        assert outcome["sum"] == 2.0


_COLLECTIVES = "all_reduce|all_gather\\w*|reduce_scatter\\w*|broadcast|batch_isend_irecv|all_to_all\\w*"


@pytest.mark.parametrize("rule, pattern, allowed", [
    ("host copies go through parallel.strict.to_host", r"\.cpu\(\)|\.to\(\s*[\"']cpu[\"']",
     {"parallel/strict.py"}),
    ("the CUDA runtime is reached through parallel/device.py only, so a rehearsal can stand in for it",
     r"torch\.cuda\b|(?<!cuda)\.record_stream\(", {"parallel/device.py"}),
    ("collectives are looked up per call, so the strict checks see them",
     rf"from torch\.distributed(\.distributed_c10d)? import [^\n]*\b({_COLLECTIVES})\b|=\s*dist\.({_COLLECTIVES})\b(?!\()",
     set()),
])
def test_the_library_has_no_way_around_the_checks(rule, pattern, allowed):
    offenders = []
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, PACKAGE)
            if name.endswith(".py") and relative not in allowed:
                with open(path, encoding="utf-8") as f:
                    offenders += [f"{relative}: {m.group(0)}" for m in re.finditer(pattern, f.read())]
    assert not offenders, f"{rule}: {offenders}"


_STRICT_SWITCH = """
import sys, torch.distributed as dist
from megatron_domino.parallel import ParallelState, Topology
original = dist.all_reduce
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%s", rank=0, world_size=1)
ParallelState(Topology(1)).destroy()
plain = dist.all_reduce is original
ParallelState(Topology(1), strict=True).destroy()
print(plain, dist.all_reduce is not original)
"""


def test_a_strict_state_installs_the_checks_and_a_plain_one_does_not():
    """In a fresh process (the suite's own processes have the checks from tests/conftest.py)."""
    from megatron_domino.parallel.launch import free_port
    from tests.training_runs import environment
    done = subprocess.run([sys.executable, "-c", _STRICT_SWITCH % free_port()], env=environment(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "True"]
