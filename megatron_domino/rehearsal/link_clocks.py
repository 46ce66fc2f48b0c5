"""Where a timed operation spends its modelled time: a host deadline on the CPU, a kernel on a stream on CUDA.

Both clocks keep NCCL's ordering: the operations of one channel (a process group, or one direction of a
point-to-point pair) run one after another, each starting when the previous one ends; channels run side by
side. An operation's values (``apply``) are written before it completes: at once on the CPU, on the channel's
stream on CUDA, after the caller's stream has reached the point of issue (what NCCL's kernels read is what
the caller's earlier kernels wrote).

``HostClock``: no thread and no timer; an operation is a deadline, and waiting for it sleeps until then, so
a process blocked on the timed group uses no core, and communication overlaps compute exactly as far as the
program lets it. ``StreamClock``: each channel has a stream of its own that waits for an event of the
caller's stream and then runs the link kernel (``link_kernel.py``) for the modelled time on the link's SMs;
``wait`` makes the caller's current stream wait for the operation's end event, never the host, as NCCL's
``Work.wait`` does.

Both measure what a wait exposes: the host's time asleep, or the time the caller's stream stood still at the
wait (a timing event before and after it, read by ``Exposure.settle`` once the step is synchronised).
"""
from __future__ import annotations

import time
from collections import defaultdict

from ..parallel.device import cuda


class Exposure:
    """Communication time per key (a group name, or ("peer", rank)): modelled, and exposed at waits."""

    def __init__(self):
        self.modelled: dict = defaultdict(float)
        self.exposed: dict = defaultdict(float)
        self.counts: dict = defaultdict(lambda: [0, 0])  # key -> [operations, bytes]
        self._pending: list = []  # (key, event before the wait, event after it) on CUDA

    def issued(self, key, seconds: float, nbytes: int) -> None:
        self.modelled[key] += seconds
        self.counts[key][0] += 1
        self.counts[key][1] += nbytes

    def stalled(self, key, before, after) -> None:
        self._pending.append((key, before, after))

    def settle(self) -> None:
        """Add the stalls measured by CUDA events (their stream must have passed them: synchronise first)."""
        for key, before, after in self._pending:
            self.exposed[key] += before.elapsed_time(after) / 1e3
        self._pending = []

    def take(self) -> tuple[dict, dict, dict]:
        """(modelled, exposed, counts) since the last take, settled."""
        self.settle()
        taken = dict(self.modelled), dict(self.exposed), {k: list(v) for k, v in self.counts.items()}
        self.modelled.clear(), self.exposed.clear(), self.counts.clear()
        return taken


class _HostOperation:
    def __init__(self, clock: "HostClock", key, end: float):
        self.clock, self.key, self.end = clock, key, end

    def done(self) -> bool:
        return self.clock.now() >= self.end

    def wait(self) -> None:
        remaining = self.end - self.clock.now()
        if remaining > 0:
            self.clock.sleep(remaining)
            self.clock.exposure.exposed[self.key] += remaining


class HostClock:
    """Deadlines on the host (``now`` and ``sleep`` are injectable, so tests can run on a virtual clock)."""

    def __init__(self, exposure: Exposure, now=time.perf_counter, sleep=time.sleep):
        self.exposure, self.now, self.sleep = exposure, now, sleep
        self._busy_until: dict = {}

    def run(self, channel, key, seconds: float, apply, tensors=()) -> _HostOperation:
        apply()
        start = max(self.now(), self._busy_until.get(channel, 0.0))
        self._busy_until[channel] = end = start + seconds
        return _HostOperation(self, key, end)


class _StreamOperation:
    def __init__(self, clock: "StreamClock", key, end_event):
        self.clock, self.key, self.end_event = clock, key, end_event

    def done(self) -> bool:
        return self.end_event.query()

    def wait(self) -> None:
        """The caller's current stream waits for the end event; the host does not."""
        stream = cuda.current_stream()
        before, after = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(self.end_event)
        after.record(stream)
        self.clock.exposure.stalled(self.key, before, after)


class StreamClock:
    """Operations as kernels on per-channel streams of ``device`` (``kernel``: a ``link_kernel.LinkKernel``)."""

    def __init__(self, exposure: Exposure, device, kernel):
        self.exposure, self.device, self.kernel = exposure, device, kernel
        self._streams: dict = {}

    def stream_of(self, channel):
        if channel not in self._streams:
            self._streams[channel] = cuda.Stream(self.device)
        return self._streams[channel]

    def run(self, channel, key, seconds: float, apply, tensors=(), sms: int = 16) -> _StreamOperation:
        caller, stream = cuda.current_stream(self.device), self.stream_of(channel)
        issued = cuda.Event()
        issued.record(caller)
        stream.wait_event(issued)
        with cuda.stream(stream):
            start = self.kernel.stamp(stream)
            apply()
            self.kernel.hold(stream, start, seconds, sms)
            end = cuda.Event()
            end.record(stream)
        for tensor in tensors:  # the allocator must not hand their memory out before the operation ends
            cuda.record_stream(tensor, stream)
        return _StreamOperation(self, key, end)
