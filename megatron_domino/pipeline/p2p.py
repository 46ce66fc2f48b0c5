"""Point-to-point transfers between adjacent pipeline stages.

Sends are non-blocking (the schedule never waits on them; completed ones are pruned, which
is when an activation's memory is finally released). Receives block, with a timeout that
names the peer, the tensor and the instruction, so a dead neighbour is reported instead of
hanging forever. Activations and gradients use different tags (gloo honours them; NCCL
matches in order, and the schedules keep each channel in FIFO order, so both work).
With ``variable_shapes`` the shape travels first, as a small int64 tensor.
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

ACTIVATION_TAG, GRADIENT_TAG = 0, 1
_MAX_DIMS = 8


class P2PTimeout(RuntimeError):
    pass


class P2P:
    def __init__(self, device: torch.device, timeout_s: float, variable_shapes: bool = False):
        self.device, self.variable_shapes = device, variable_shapes
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._pending_sends: list[tuple[object, torch.Tensor]] = []
        self._wait_seconds = 0.0

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        if self.variable_shapes:
            shape = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64, device=self.device)
            shape[0] = tensor.dim()
            shape[1:tensor.dim() + 1] = torch.tensor(tensor.shape)
            self._pending_sends.append((dist.isend(shape, dst, tag=tag), shape))
        self._pending_sends.append((dist.isend(tensor, dst, tag=tag), tensor))
        self.prune()

    def recv(self, shape, dtype, src: int, tag: int, what: str) -> torch.Tensor:
        if self.variable_shapes:
            header = torch.empty(_MAX_DIMS + 1, dtype=torch.int64, device=self.device)
            self._wait(dist.irecv(header, src, tag=tag), src, f"shape of {what}")
            shape = tuple(header[1:int(header[0]) + 1].tolist())
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(dist.irecv(buffer, src, tag=tag), src, what)
        return buffer

    def take_wait_seconds(self) -> float:
        """Time spent blocked in receives since the last call (the timers' "p2p-wait")."""
        seconds, self._wait_seconds = self._wait_seconds, 0.0
        return seconds

    def _wait(self, work, src: int, what: str) -> None:
        start = time.perf_counter()
        try:
            completed = work.wait(self.timeout)
        except RuntimeError as error:
            raise P2PTimeout(f"pipeline receive of {what} from rank {src} failed or timed out after "
                             f"{self.timeout.total_seconds():.0f}s: {error}") from error
        self._wait_seconds += time.perf_counter() - start
        if completed is False:
            raise P2PTimeout(f"pipeline receive of {what} from rank {src} timed out after "
                             f"{self.timeout.total_seconds():.0f}s")

    def prune(self) -> None:
        """Drop sends that have completed, releasing their buffers."""
        self._pending_sends = [(w, t) for w, t in self._pending_sends if not w.is_completed()]

    def drain(self) -> None:
        for work, _ in self._pending_sends:
            work.wait(self.timeout)
        self._pending_sends = []
