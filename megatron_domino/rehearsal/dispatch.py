"""The dispatch mode a rehearsal runs under, above torch's ``FakeTensorMode``: every op passes here first.

Per op, in order: page-locked memory for fake host tensors (``pin_memory``, ``is_pinned``); the host-sync
check; the device of every tensor a collective is given; host reads answered from shadows (``shadows.py``); ops
on real host tensors only (the data pipeline's), and small host tensors made from nothing, run for real, so host-side values stay exact
(large host tensors, such as a full-size weight before it is sharded, stay fake); data-dependent shapes
sized from shadows; then the op itself on fake tensors, the shadows it propagates, the collectives it
issues and the storages it allocates.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

from . import shadows
from .host_syncs import pinned
from .kernels import SCALED_MM_INTO, scaled_mm_into
from .shadows import is_fake, tensors_in

aten, c10d = torch.ops.aten, torch.ops.c10d
# ops that write into a buffer of their own (not in place): their outputs are communication buffers
_RECEIVING = {c10d.recv_.default, c10d._allgather_base_.default, c10d._reduce_scatter_base_.default,
              c10d.alltoall_base_.default, c10d.allgather_.default, c10d.alltoall_.default}


class RehearsalError(RuntimeError):
    pass


def _check_devices(func, args) -> None:
    """A collective's tensors must be the device's: NCCL takes CUDA tensors only, where gloo and the fake process
    group take any (so a host tensor handed to a collective passes every CPU test and fails on the first GPU)."""
    for tensor in tensors_in(args):
        if tensor.device.type != "cuda":
            raise RehearsalError(f"{func} was given a {tensor.device.type} tensor of shape {tuple(tensor.shape)}: an "
                                 f"NCCL group takes CUDA tensors only. Fix: make it on the rank's device (or move it "
                                 f"there) before the collective")


def _on_host(inputs: list, kwargs) -> bool:
    """Whether an op works on the host only: real host tensors in (or none), host tensors out."""
    device = kwargs.get("device")
    return ((device is None or torch.device(device).type == "cpu")
            and not any(is_fake(t) or t.device.type != "cpu" for t in inputs))


class RehearsalMode(TorchDispatchMode):
    def __init__(self, memory, syncs, collectives):
        super().__init__()
        self.memory, self.syncs, self.collectives = memory, syncs, collectives

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._pin_memory.default:
            return self._pin(args[0])
        if func is aten.is_pinned.default:
            return pinned(args[0])
        if func in SCALED_MM_INTO:
            return scaled_mm_into(func, args, kwargs)
        self.syncs.check(func, args, kwargs)
        if func.namespace == "c10d":
            _check_devices(func, args)
        if func is aten._local_scalar_dense.default and is_fake(args[0]):
            return self._read(args[0])
        inputs = tensors_in((args, kwargs))
        host = _on_host(inputs, kwargs)
        if host and inputs:  # the data pipeline's work on real host tensors: done for real, values exact
            with _disable_current_modes():
                return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            self.syncs.data_dependent(func)
            out = self._sized_by_shadows(func, args, kwargs)
        outputs = tensors_in(out)
        if host and all(isinstance(t, torch.Tensor) and t.numel() <= shadows.LIMIT for t in outputs):
            with _disable_current_modes():  # a small host tensor made from nothing (zeros, arange): made real
                return func(*args, **kwargs)
        shadows.propagate(func, args, kwargs, out, outputs)
        if kwargs.get("pin_memory") and is_fake(out):  # a large torch.empty(..., pin_memory=True)
            out._pinned = True
        if func.namespace == "c10d":
            self.collectives.count(func, args)
        if func in _RECEIVING:
            self.memory.claim(tensors_in(args[0]), "communication")
        self.memory.track(outputs)
        return out

    @staticmethod
    def _pin(tensor: torch.Tensor) -> torch.Tensor:
        """``pin_memory()``: real host tensors are really page-locked (the fake CUDA library's allocator);
        a fake one becomes a fake copy marked page-locked, with the same strides, as torch's is."""
        if not is_fake(tensor):
            with _disable_current_modes():
                return tensor.pin_memory()
        copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
        copy._pinned = True
        known = shadows.shadow_of(tensor)
        if known is not None:
            with _disable_current_modes():
                copy._shadow = known.clone()
        return copy

    @staticmethod
    def _read(tensor: torch.Tensor):
        known = shadows.shadow_of(tensor)
        if known is not None:
            with _disable_current_modes():
                return known.item()
        return False if tensor.dtype == torch.bool else 0 if not tensor.dtype.is_floating_point else 0.0

    @staticmethod
    def _sized_by_shadows(func, args, kwargs):
        real = shadows.real_result(func, args, kwargs)
        if real is None:
            raise RehearsalError(f"{func}: its output shape depends on values the rehearsal does not know "
                                 f"(no shadow: see rehearsal/shadows.py)")
        device = tensors_in((args, kwargs))[0].device

        def fake_like(value):
            if not isinstance(value, torch.Tensor):
                return value
            out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
            out._shadow = value
            return out
        return tree_map(fake_like, real)
