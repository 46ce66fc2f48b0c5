"""Point-to-point transfers between pipeline stages, issued the way NCCL needs them.

NCCL ignores tags, matches a pair's transfers in issue order, and completes a large send
only once the peer's receive runs. So every transfer goes out in a group
(``batch_isend_irecv``) that the schedule built to pair a send with the receive its peer
is waiting to post (see ``schedules.add_transfers``), no tags are used, and nothing
relies on buffering.

A group completes as a whole. On a backend that coalesces (NCCL) ``batch_isend_irecv`` returns ONE
work for the whole group; gloo returns one per operation. Either way the group's works are kept
together (``GroupWork``) and waiting for any receive of a group waits for all of it, sends included,
which is what NCCL does. The wait happens when a received tensor is first needed (``Arrival``), not
when the group is issued: on CUDA it is a stream wait placed just before the consuming compute, so
everything queued before it runs without waiting for the transfer, and the CPU never blocks; on the
CPU (gloo) it blocks with the collective timeout, naming the peer. A dead peer is reported by the
watchdog either way: its timeout is the shorter one. Sends are kept until their group completes, so
their buffers live as long as NCCL reads them. With ``variable_shapes`` a group first exchanges the
shapes (one int64 tensor per transfer), and a receive reads its shape on the host.

On NCCL, ``init_process_group(device_id=...)`` creates the communicator eagerly, which
batched p2p needs when it is the first operation a group sees.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

_MAX_DIMS = 8
ACTIVATION, GRADIENT, SHAPE = 0, 1, 2  # what travels; the strict transport checks both sides agree


class P2PTimeout(RuntimeError):
    pass


@dataclass
class Transfer:
    """One side of a point-to-point transfer: a send of ``tensor`` or a receive of ``shape``/``dtype``."""

    peer: int  # global rank
    label: str  # "activation F3.1 for stage 2", for reports
    key: tuple[int, int, int]  # (ACTIVATION | GRADIENT | SHAPE, micro-batch, receiving virtual stage)
    tensor: torch.Tensor | None = None  # set on a send
    shape: tuple | None = None  # set on a receive
    dtype: torch.dtype | None = None
    into: torch.Tensor | None = None  # a receive's own buffer (default: a new one of ``shape`` and ``dtype``)

    @property
    def is_send(self) -> bool:
        return self.tensor is not None


class GroupWork:
    """The works of one ``batch_isend_irecv`` group, completed as a whole: one work on NCCL, one per
    operation on gloo (never matched to the operations one by one)."""

    def __init__(self, works: list):
        self.works, self.done = list(works), False

    def is_completed(self) -> bool:
        return self.done or all(work.is_completed() for work in self.works)


class Arrival:
    """A posted receive; ``wait()`` returns its tensor once its group has completed (on CUDA: for the
    current stream)."""

    def __init__(self, p2p: P2P, group: GroupWork, transfer: Transfer, tensor: torch.Tensor):
        self._p2p, self._group, self.transfer, self.tensor = p2p, group, transfer, tensor

    def wait(self) -> torch.Tensor:
        self._p2p._wait(self._group, self.transfer)
        return self.tensor


class P2P:
    def __init__(self, device: torch.device, timeout_s: float | None, variable_shapes: bool = False):
        """``timeout_s``: the run's collective timeout (the parallel state's; None: torch's default)."""
        self.device, self.variable_shapes = device, variable_shapes
        self.timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else dist.default_pg_timeout
        self.waits_on_stream = device.type == "cuda"
        self._pending_sends: list[tuple[GroupWork, torch.Tensor]] = []
        self._wait_seconds = 0.0

    def exchange(self, transfers: list[Transfer]) -> list[torch.Tensor]:
        """Issue ``transfers`` as one group and wait for its receives; returns them in the order of the receives."""
        return [arrival.wait() for arrival in self.post(transfers)]

    def post(self, transfers: list[Transfer]) -> list[Arrival]:
        """Issue ``transfers`` as one group; returns the receives, in order, to be waited for when needed."""
        if self.variable_shapes:
            self._exchange_shapes(transfers)
        return self._post(transfers)

    def _post(self, transfers: list[Transfer]) -> list[Arrival]:
        buffers = [t.tensor.detach().contiguous() if t.is_send else t.into if t.into is not None else
                   torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in transfers]
        group = GroupWork(self._launch(transfers, buffers))
        received = []
        for transfer, buffer in zip(transfers, buffers):
            if transfer.is_send:
                self._pending_sends.append((group, buffer))
            else:
                received.append(Arrival(self, group, transfer, buffer))
        self.prune()
        return received

    def _exchange_shapes(self, transfers: list[Transfer]) -> None:
        """Send each tensor's shape ahead of it, and fill in each receive's shape: the one host read of this
        mode (docs/design/nccl-rules.md), which is why ``log.sync_debug`` refuses it. A receive's header holds
        the shape it expects until the peer's arrives (a rehearsal, whose receives bring no values, reads that)."""
        shapes = []
        for t in transfers:
            header = self._header(t.tensor.shape if t.is_send else t.shape or ())
            shapes.append(Transfer(t.peer, f"shape of {t.label}", (SHAPE,) + t.key[1:],
                                   tensor=header if t.is_send else None, shape=None if t.is_send else header.shape,
                                   dtype=header.dtype, into=None if t.is_send else header))
        received = iter(self._post(shapes))
        for t in transfers:
            if not t.is_send:
                header = next(received).wait().tolist()
                t.shape = tuple(header[1:header[0] + 1])

    def _header(self, shape) -> torch.Tensor:
        """[dims, *shape, 0...] on the device: written in page-locked host memory, moved by one non-blocking
        copy (a tensor built on the device from host values would be two blocking copies)."""
        values = [len(shape), *shape] + [0] * (_MAX_DIMS - len(shape))
        host = torch.tensor(values, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)

    def _launch(self, transfers: list[Transfer], buffers: list[torch.Tensor]) -> list:
        """Issue the group; returns its works (how many depends on the backend: see ``GroupWork``)."""
        ops = [dist.P2POp(dist.isend if t.is_send else dist.irecv, buffer, t.peer)
               for t, buffer in zip(transfers, buffers)]
        return dist.batch_isend_irecv(ops)

    def take_wait_seconds(self) -> float:
        """CPU time blocked in receives since the last call (the timers' "p2p-wait"; 0 on CUDA, where
        receives are waited on the stream)."""
        seconds, self._wait_seconds = self._wait_seconds, 0.0
        return seconds

    def _wait(self, group: GroupWork, transfer: Transfer | None) -> None:
        """Wait for ``group`` as a whole (``transfer``: what the wait is for, named if it times out)."""
        if group.done:
            return
        if self.waits_on_stream:
            for work in group.works:
                work.wait()  # the current stream waits; the CPU does not
            group.done = True
            return
        start = time.perf_counter()
        what = (f"pipeline receive of {transfer.label} from rank {transfer.peer}" if transfer is not None
                else "pipeline send at the end of the schedule")
        for work in group.works:
            try:
                completed = work.wait(self.timeout)
            except RuntimeError as error:
                raise P2PTimeout(f"{what} failed or timed out after {self.timeout.total_seconds():.0f}s: "
                                 f"{error}") from error
            if completed is False:
                raise P2PTimeout(f"{what} timed out after {self.timeout.total_seconds():.0f}s")
        self._wait_seconds += time.perf_counter() - start
        group.done = True

    def prune(self) -> None:
        """Drop sends whose group has completed, releasing their buffers."""
        self._pending_sends = [(g, t) for g, t in self._pending_sends if not g.is_completed()]

    def drain(self) -> None:
        """Wait for every send's group (on the stream under CUDA): the end of a schedule."""
        for group, _ in self._pending_sends:
            self._wait(group, None)
        self._pending_sends = []
