"""Point-to-point transfers between pipeline stages, issued the way NCCL needs them.

NCCL ignores tags, matches a pair's transfers in issue order, and completes a large send
only once the peer's receive runs. So every transfer goes out in a group
(``batch_isend_irecv``) that the schedule built to pair a send with the receive its peer
is waiting to post (see ``schedules.add_transfers``), no tags are used, and nothing
relies on buffering. A receive is waited for only when its tensor is needed (``Arrival``), so a
group's later receive does not hold up the compute that needs only an earlier one. On CUDA the
wait goes on the compute stream and the CPU runs on; on the CPU (gloo) it blocks with the
collective timeout, naming the peer. A dead
peer is reported by the watchdog either way: its timeout is the shorter one. Sends are
kept until complete, so their buffers live as long as NCCL reads them. With
``variable_shapes`` a group first exchanges the shapes (one int64 tensor per transfer).

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

    @property
    def is_send(self) -> bool:
        return self.tensor is not None


class Arrival:
    """A posted receive; ``wait()`` returns its tensor once it has arrived (on CUDA: for the current stream)."""

    def __init__(self, p2p: "P2P", work, transfer: Transfer, tensor: torch.Tensor):
        self._p2p, self._work, self.transfer, self.tensor = p2p, work, transfer, tensor

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._p2p._wait(self._work, self.transfer)
            self._work = None
        return self.tensor


class P2P:
    def __init__(self, device: torch.device, timeout_s: float, variable_shapes: bool = False):
        self.device, self.variable_shapes = device, variable_shapes
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.waits_on_stream = device.type == "cuda"
        self._pending_sends: list[tuple[object, torch.Tensor]] = []
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
        buffers = [t.tensor.detach().contiguous() if t.is_send else
                   torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in transfers]
        works = self._launch(transfers, buffers)
        received = []
        for transfer, buffer, work in zip(transfers, buffers, works):
            if transfer.is_send:
                self._pending_sends.append((work, buffer))
            else:
                received.append(Arrival(self, work, transfer, buffer))
        self.prune()
        return received

    def _exchange_shapes(self, transfers: list[Transfer]) -> None:
        """Send each tensor's shape ahead of it, and fill in each receive's shape."""
        headers = []
        for t in transfers:
            header = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64, device=self.device)
            if t.is_send:
                header[0] = t.tensor.dim()
                header[1:t.tensor.dim() + 1] = torch.tensor(t.tensor.shape)
            headers.append(header)
        shapes = [Transfer(t.peer, f"shape of {t.label}", (SHAPE,) + t.key[1:],
                           tensor=h if t.is_send else None, shape=None if t.is_send else h.shape, dtype=h.dtype)
                  for t, h in zip(transfers, headers)]
        received = iter(self._post(shapes))
        for t in transfers:
            if not t.is_send:
                header = next(received).wait()
                t.shape = tuple(header[1:int(header[0]) + 1].tolist())

    def _launch(self, transfers: list[Transfer], buffers: list[torch.Tensor]) -> list:
        ops = [dist.P2POp(dist.isend if t.is_send else dist.irecv, buffer, t.peer)
               for t, buffer in zip(transfers, buffers)]
        return dist.batch_isend_irecv(ops)

    def take_wait_seconds(self) -> float:
        """CPU time blocked in receives since the last call (the timers' "p2p-wait"; 0 on CUDA, where
        receives are waited on the stream)."""
        seconds, self._wait_seconds = self._wait_seconds, 0.0
        return seconds

    def _wait(self, work, transfer: Transfer) -> None:
        if self.waits_on_stream:
            work.wait()  # the current stream waits; the CPU does not
            return
        start = time.perf_counter()
        try:
            completed = work.wait(self.timeout)
        except RuntimeError as error:
            raise P2PTimeout(f"pipeline receive of {transfer.label} from rank {transfer.peer} failed or timed out "
                             f"after {self.timeout.total_seconds():.0f}s: {error}") from error
        self._wait_seconds += time.perf_counter() - start
        if completed is False:
            raise P2PTimeout(f"pipeline receive of {transfer.label} from rank {transfer.peer} timed out after "
                             f"{self.timeout.total_seconds():.0f}s")

    def prune(self) -> None:
        """Drop sends that have completed, releasing their buffers."""
        self._pending_sends = [(w, t) for w, t in self._pending_sends if not w.is_completed()]

    def drain(self) -> None:
        """Wait for every send (on the stream under CUDA): the end of a schedule."""
        for work, _ in self._pending_sends:
            work.wait() if self.waits_on_stream else work.wait(self.timeout)
        self._pending_sends = []
