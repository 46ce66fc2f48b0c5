"""A pipeline transport that makes gloo obey NCCL's point-to-point rules, so CPU tests catch GPU hangs.

gloo buffers every send and honours tags, so a schedule that deadlocks on NCCL can pass on
gloo. This transport removes both reliefs:
- data travel untagged, so a pair's transfers match purely by issue order, as on NCCL;
- a send starts only once its receiver has posted the matching receive (a rendezvous, which is
  what NCCL does with any tensor larger than its buffer): each receiver announces every receive
  to its sender on a side channel, saying what it expects there (activation or gradient,
  micro-batch, stage, dtype, shape), and the sender waits for that announcement;
- the receives of a group are announced before any of its sends waits, and the group comes back
  as ONE work that completes when all of its operations have, which is what NCCL's
  ``batch_isend_irecv`` returns (gloo returns one work per operation): code that pairs works with
  operations loses receives here as it would on NCCL.
A send whose receive is never posted times out with the message NCCL never gives (the deadlock,
named); an announcement that does not describe what is being sent is an error too (NCCL would
deliver the wrong tensor). The switch is the parallel state's ``strict`` (``parallel.strict_transport:
true``; the test suite's configs and parallel states set it).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .p2p import ACTIVATION, GRADIENT, SHAPE, P2P, P2PTimeout, Transfer

_ANNOUNCE_TAG = 1  # the side channel (gloo honours tags); data use the default tag, as on NCCL
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
_MAX_DIMS = 8
_KINDS = {ACTIVATION: "activation", GRADIENT: "gradient", SHAPE: "shape header"}


def _describe(key: tuple, buffer: torch.Tensor) -> torch.Tensor:
    """What one side of a transfer means, as the int64 vector the two sides compare."""
    if buffer.dim() > _MAX_DIMS:
        raise ValueError(f"pipeline transfer of a {buffer.dim()}-dimensional tensor: at most {_MAX_DIMS} supported")
    code = _DTYPES.index(buffer.dtype) if buffer.dtype in _DTYPES else len(_DTYPES)
    shape = list(buffer.shape) + [-1] * (_MAX_DIMS - buffer.dim())
    return torch.tensor(list(key) + [code, buffer.dim()] + shape, dtype=torch.int64)


def _render(description: torch.Tensor) -> str:
    kind, microbatch, stage, code, dims, *shape = description.tolist()
    dtype = _DTYPES[code] if code < len(_DTYPES) else "another dtype"
    return (f"{_KINDS.get(kind, kind)} of micro-batch {microbatch} for stage {stage} "
            f"({dtype}, shape {tuple(shape[:dims])})")


class CoalescedWork:
    """NCCL's answer to a ``batch_isend_irecv``: one work for the whole group, complete when all of it is."""

    def __init__(self, works: list):
        self._works = works

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            if (work.wait(timeout) if timeout is not None else work.wait()) is False:
                return False
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class StrictP2P(P2P):
    """``P2P`` with NCCL's rendezvous and order rules enforced on gloo (gloo only: the announcements are
    small tagged sends that gloo buffers; NCCL would neither honour the tag nor take a CPU tensor)."""

    def __init__(self, device: torch.device, timeout_s: float | None, variable_shapes: bool = False):
        if dist.get_backend() != "gloo":
            raise ValueError(f"the strict pipeline transport emulates NCCL's rules on gloo, but the backend is "
                             f"{dist.get_backend()!r}. Fix: leave parallel.strict_transport off there; NCCL "
                             f"enforces its rules itself")
        super().__init__(device, timeout_s, variable_shapes)
        self._announcements: list[tuple[object, torch.Tensor]] = []

    def _launch(self, transfers: list[Transfer], buffers: list[torch.Tensor]) -> list:
        for transfer, buffer in zip(transfers, buffers):
            if not transfer.is_send:
                announcement = _describe(transfer.key, buffer)
                self._announcements.append((dist.isend(announcement, transfer.peer, tag=_ANNOUNCE_TAG),
                                            announcement))
        for transfer, buffer in zip(transfers, buffers):
            if transfer.is_send:
                self._await_receiver(transfer, _describe(transfer.key, buffer))
        self._announcements = [(w, t) for w, t in self._announcements if not w.is_completed()]
        return [CoalescedWork(super()._launch(transfers, buffers))]

    def _await_receiver(self, transfer: Transfer, mine: torch.Tensor) -> None:
        theirs = torch.empty_like(mine)
        seconds = self.timeout.total_seconds()
        try:
            posted = dist.irecv(theirs, transfer.peer, tag=_ANNOUNCE_TAG).wait(self.timeout)
        except RuntimeError as error:
            posted, cause = False, f": {error}"
        else:
            cause = ""
        if posted is False:
            raise P2PTimeout(f"send of {transfer.label} to rank {transfer.peer}: the receiver did not post the "
                             f"matching receive within {seconds:.0f}s{cause}. Under NCCL's rules this send would "
                             f"block forever: the two ranks' transfer orders deadlock (strict transport)")
        if not torch.equal(theirs, mine):
            raise RuntimeError(f"pipeline transfer order mismatch (strict transport): this rank sends "
                               f"{_render(mine)} to rank {transfer.peer}, whose receive at that position expects "
                               f"{_render(theirs)}. NCCL matches a pair's transfers by order only, so it would "
                               f"deliver the wrong tensor. Fix: send and receive in the same order on both ranks")

    def drain(self) -> None:
        super().drain()
        for work, _ in self._announcements:
            work.wait(self.timeout)
        self._announcements = []
