"""NCCL's rules, enforced on gloo: the debug switch and the device check at every collective.

An NCCL group serves CUDA tensors only: a host tensor handed to it fails ("no backend for
device type cpu"), typically at the first checkpoint on a GPU cluster. On the CPU test
machines every tensor is a host tensor, so the device alone cannot tell a mistake. Here the
library's host copies are marked instead: ``to_host`` is the one way the library moves a
tensor off its device, and under the strict switch its result is a ``HostCopy`` (a tensor
subclass that survives views and arithmetic). The check wrapped around every
``torch.distributed`` collective the library calls then refuses
- a ``HostCopy`` on any group (the groups are NCCL-only on GPUs), and
- a tensor whose device type the group's backends do not serve.

The switch is the parallel state's ``strict`` (``parallel.strict_transport: true``), which also selects
the strict pipeline transport (``pipeline/strict_transport.py``); the test suite turns the checks on in
every process it starts. torch.distributed is one per process, so the wrapping is too: once installed
(by the first strict state, or a test fixture) it stays, a debugging aid that checks and never alters.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

# Collectives and batched p2p whose tensors must live where the group serves. Plain isend/irecv stay
# unwrapped: P2POp accepts only the original functions (the batch they go into is checked).
_CHECKED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
            "reduce_scatter_single", "reduce_scatter", "broadcast", "reduce", "all_to_all_single", "all_to_all",
            "batch_isend_irecv")
_installed: dict[str, object] = {}


class HostCopy(torch.Tensor):
    """Marks a tensor the library copied to host memory (strict mode only)."""


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy in host memory, for files and logs; never to be handed to a collective."""
    copy = tensor.detach().to("cpu", copy=True)
    return copy.as_subclass(HostCopy) if _installed else copy


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item.tensor if isinstance(item, dist.P2POp) else item)


def served_devices(group) -> set[str]:
    """Device types the group's backends serve: from 'cpu:gloo,cuda:gloo' or 'cuda:nccl'."""
    config = dist.get_backend_config(group)
    return {entry.split(":")[0] for entry in config.split(",")}


def check_collective(name: str, args: tuple, kwargs: dict) -> None:
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    served = served_devices(group if group is not None else dist.group.WORLD)
    for tensor in (t for value in list(args) + list(kwargs.values()) for t in _tensors(value)):
        if isinstance(tensor, HostCopy):
            raise RuntimeError(f"torch.distributed.{name} was given a host copy (made by to_host) of shape "
                               f"{tuple(tensor.shape)}: on GPUs the groups are NCCL-only and this fails with 'no "
                               f"backend for device type cpu'. Fix: run the collective on the device tensor and "
                               f"copy the result to the host afterwards (strict mode)")
        if tensor.device.type not in served:
            raise RuntimeError(f"torch.distributed.{name} was given a {tensor.device.type} tensor on a group that "
                               f"serves {sorted(served)}. Fix: move it to the group's device first (strict mode)")


def install_collective_checks() -> None:
    """Wrap torch.distributed's collectives with ``check_collective`` (idempotent; process-wide, for debugging)."""
    for name in _CHECKED:
        if name in _installed or not hasattr(dist, name):
            continue
        original = getattr(dist, name)

        @functools.wraps(original)
        def checked(*args, _original=original, _name=name, **kwargs):
            check_collective(_name, args, kwargs)
            return _original(*args, **kwargs)

        _installed[name] = original
        setattr(dist, name, checked)
