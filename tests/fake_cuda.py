"""Run a test function in a fresh process that has the fake CUDA device (megatron_domino/rehearsal/fake_cuda.py).

The device must be loaded before torch is imported, and pytest has imported torch already, so the function
runs in a child interpreter: ``on_fake_cuda("tests.test_x:_check", arg, ...)`` returns what the function
returned (JSON-serialisable), re-raises its failure with the child's traceback, and skips the test where the
fake device cannot be built (no C++ compiler), saying why.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MARK = "FAKE-CUDA-RESULT "
_CHILD = f"""
import importlib, json, os, sys
from megatron_domino.rehearsal import fake_cuda
try:
    fake_cuda.load()
except fake_cuda.FakeCudaUnavailable as reason:
    print("FAKE-CUDA-UNAVAILABLE", reason)
    sys.exit(3)
module, name = sys.argv[1].split(":")
result = getattr(importlib.import_module(module), name)(*json.loads(sys.argv[2]))
print({_MARK!r} + json.dumps(result), flush=True)
os._exit(0)  # skip teardown: autograd's per-device threads of the fake device can abort the interpreter's exit
"""


def _start(target: str, args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", _CHILD, target, json.dumps(args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(target: str, child: subprocess.Popen, timeout: float):
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        stdout, stderr = child.communicate()
        raise AssertionError(f"{target} on the fake CUDA device timed out after {timeout:.0f}s:\n{stderr[-3000:]}")
    if child.returncode == 3 and "FAKE-CUDA-UNAVAILABLE" in stdout:
        pytest.skip(stdout.split("FAKE-CUDA-UNAVAILABLE", 1)[1].strip())
    if child.returncode != 0:
        raise AssertionError(f"{target} failed on the fake CUDA device:\n{stdout[-3000:]}\n{stderr[-6000:]}")
    line = next(line for line in stdout.splitlines()[::-1] if line.startswith(_MARK))
    return json.loads(line[len(_MARK):])


def on_fake_cuda(target: str, *args, timeout: float = 300.0):
    return _result(target, _start(target, args), timeout)


def on_fake_cuda_side_by_side(calls: list[tuple[str, tuple]], timeout: float = 600.0) -> list:
    """Several ``(target, args)`` at once, one child process each (the CPU's cores share them out)."""
    children = [(target, _start(target, args)) for target, args in calls]
    try:
        return [_result(target, child, timeout) for target, child in children]
    finally:
        for _, child in children:
            if child.poll() is None:
                child.kill()


def fake_fp8_modes():
    """In the child: fake tensors, with FP8's GEMM into a buffer run as the rehearsal runs it (no fake kernel of its
    own: ``rehearsal.kernels.scaled_mm_into``)."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_domino.rehearsal.kernels import SCALED_MM_INTO, scaled_mm_into

    class OutForm(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in SCALED_MM_INTO:
                return scaled_mm_into(func, args, kwargs)
            return func(*args, **(kwargs or {}))
    modes = contextlib.ExitStack()
    modes.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
    modes.enter_context(OutForm())
    return modes
