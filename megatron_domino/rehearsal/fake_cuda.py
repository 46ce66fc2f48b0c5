"""Build and load the fake CUDA device (``fake_cuda.cpp``) into a process that has not imported torch yet.

The library registers CUDA's device guard and hooks with c10 and ATen; ATen reads its hooks once, so the
library must be in the process before torch is. ``load()`` therefore refuses to run after ``import torch``,
and this module imports nothing of torch itself: it finds the installed torch's headers and libraries by
path. The library is compiled once per (source, torch build) with g++ into a cache folder and reused.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

from ..files import publish  # imports no torch either

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cuda.cpp")
_loaded: ctypes.CDLL | None = None


class FakeCudaUnavailable(RuntimeError):
    """The fake device cannot be built here (no compiler, no torch headers): a reason, not a bug."""


def torch_dir() -> str:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise FakeCudaUnavailable("torch is not installed")
    return os.path.dirname(spec.origin)


def _torch_build_id(root: str) -> str:
    """What the library is compiled against: torch's version file and its C10 library's size."""
    with open(os.path.join(root, "version.py"), encoding="utf-8") as f:
        version = f.read()
    return f"{version}|{os.path.getsize(os.path.join(root, 'lib', 'libc10.so'))}"


def cache_dir() -> str:
    return os.environ.get("MEGATRON_DOMINO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "megatron_domino"))


def build() -> str:
    """The compiled library's path, compiling it first if this source and torch build have none yet."""
    root = torch_dir()
    if not os.path.isdir(os.path.join(root, "include", "c10")):
        raise FakeCudaUnavailable(f"torch at {root} ships no C++ headers")
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise FakeCudaUnavailable("no C++ compiler (g++) on PATH: install one (apt-get install g++) or set CXX")
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + _torch_build_id(root).encode()).hexdigest()[:16]
    target = os.path.join(cache_dir(), f"libfake_cuda-{key}.so")
    if os.path.exists(target):
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as scratch:
        built = os.path.join(scratch, "libfake_cuda.so")
        command = [compiler, "-O1", "-shared", "-fPIC", "-std=c++20", "-w", f"-I{root}/include", SOURCE,
                   f"-L{root}/lib", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root}/lib", "-o", built]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise FakeCudaUnavailable(f"compiling {SOURCE} failed:\n{result.stderr[-3000:]}")
        publish(built, target)  # a concurrent build never sees half a library
    return target


def load() -> ctypes.CDLL:
    """Put the fake CUDA device into this process (idempotent); must come before ``import torch``."""
    global _loaded
    if _loaded is not None:
        return _loaded
    if "torch" in sys.modules:
        raise RuntimeError("the fake CUDA device must be loaded before torch is imported (ATen reads its CUDA "
                           "hooks once). Fix: call megatron_domino.rehearsal.fake_cuda.load() first, in a fresh "
                           "process (tools/rehearse.py does)")
    library = ctypes.CDLL(build(), mode=ctypes.RTLD_GLOBAL)
    library.fake_cuda_current_device.restype = ctypes.c_int
    library.fake_cuda_device_count.restype = ctypes.c_int
    _loaded = library
    return library


def library() -> ctypes.CDLL:
    if _loaded is None:
        raise RuntimeError("the fake CUDA device is not loaded: call fake_cuda.load() before importing torch")
    return _loaded
