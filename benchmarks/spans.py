"""Per-rank timelines of compute and communication, recorded inside a benchmark only, as a Chrome trace.

While ``SpanRecorder.recording()`` is active, torch.distributed's all_reduce / batch_isend_irecv are wrapped
(the package calls them through the ``torch.distributed`` module, so nothing in it changes). Each call
records where it was issued (the Domino layer, phase and mu-chunk in forward; in backward the
column-parallel linear whose input gradient it reduces, see ``tagged_backward``, else the autograd
node), when it was launched, when it completed (collectives: a completion callback; point-to-point:
the wait, or the first poll that found it done) and how long this rank's main thread was *blocked* on it.
Everything else the main thread does inside the step is compute: the timeline a reader needs to see
which communication is hidden and which is exposed.

Open the written file in chrome://tracing or https://ui.perfetto.dev: one process per rank; the thread
"main" holds compute / blocked spans, "phase" the pipeline's forward and backward ops, "comm k" the
communications in flight (one lane per concurrent operation).
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from common import write_json

WRAPPED = ("all_reduce", "batch_isend_irecv")
_COMMUNICATING_NODES = ("LinearWithAsyncInputGradientBackward", "CopyToTensorParallelBackward")
_TAG = "benchmark_issued_at"
_PACKAGE = os.sep + "megatron_domino" + os.sep
_EXECUTOR = os.path.join("domino", "executor.py")
_PLUMBING = ("parallel" + os.sep + "comm.py", "tensor_parallel" + os.sep + "async_comm.py")


def now() -> float:
    return time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process on the machine


def where_issued(op: str) -> str:
    """'all_reduce fwd launch layer 3 mlp chunk 1' (the Domino step that ``domino.executor.run_order`` is
    running), 'all_reduce bwd layers.3.mlp.fc1 #1', 'batch_isend_irecv p2p._launch' (the package function that
    called). The library keeps no trace hook: the running step is read from the executor's frame."""
    node = torch._C._current_autograd_node()
    if node is not None:
        return f"{op} bwd {node.metadata.get(_TAG, node.name())}"
    frame, caller = sys._getframe(2), None
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_EXECUTOR) and code.co_name == "run_order" and "step" in frame.f_locals:
            return f"{op} fwd {frame.f_locals['step'].trace_name()}"
        if caller is None and _PACKAGE in code.co_filename and not code.co_filename.endswith(_PLUMBING):
            caller = f"{op} {os.path.basename(code.co_filename)[:-3]}.{code.co_name}"
        frame = frame.f_back
    return caller or f"{op} outside the package"


class _TimedWork:
    """A Work handle that reports its wait and completion to the recorder; otherwise the same."""

    def __init__(self, work, recorder: "SpanRecorder", label: str, launched: float, nbytes: int):
        self._work, self._recorder = work, recorder
        self.label, self.launched, self.nbytes, self.completed = label, launched, nbytes, None
        try:
            work.get_future().add_done_callback(self._done)
        except RuntimeError:  # point-to-point Work has no future: completion is seen at wait / poll
            pass

    def _done(self, _future) -> None:
        self.completed = now()

    def wait(self, *args, **kwargs):
        start = now()
        result = self._work.wait(*args, **kwargs)
        end = now()
        self._recorder.blocked(f"wait {self.label}", start, end)
        self.completed = self.completed or end
        return result

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done and self.completed is None:
            self.completed = now()
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


class SpanRecorder:
    def __init__(self, rank: int):
        self.rank = rank
        self.main: list[tuple[str, float, float]] = []  # blocked spans of the main thread
        self.phases: list[tuple[str, float, float]] = []
        self.works: list[_TimedWork] = []
        self.sync_comms: list[tuple[str, float, float, int]] = []
        self.window: tuple[float, float] | None = None

    def blocked(self, label: str, start: float, end: float) -> None:
        self.main.append((label, start, end))

    def phase(self, label: str, start: float, end: float) -> None:
        self.phases.append((label, start, end))

    def _wrap(self, op: str, function):
        def call(*args, **kwargs):
            label = where_issued(op)
            tensor = args[0] if args else kwargs.get("tensor")
            nbytes = tensor.numel() * tensor.element_size() if torch.is_tensor(tensor) else 0
            start = now()
            work = function(*args, **kwargs)
            end = now()
            if work is None:  # a synchronous collective: launched and waited in one call
                self.blocked(label, start, end)
                self.sync_comms.append((label, start, end, nbytes))
                return None
            if isinstance(work, list):  # batch_isend_irecv: one Work per op on gloo, one for the group on NCCL
                total = sum(op.tensor.numel() * op.tensor.element_size() for op in args[0])
                timed = [_TimedWork(w, self, label, start, total // max(1, len(work))) for w in work]
                self.works += timed
                return timed
            timed = _TimedWork(work, self, label, start, nbytes)
            self.works.append(timed)
            return timed
        return call

    @contextlib.contextmanager
    def recording(self):
        """Record every wrapped call made inside the block; the block's span is the step window."""
        originals = {op: getattr(dist, op) for op in WRAPPED}
        for op, function in originals.items():
            setattr(dist, op, self._wrap(op, function))
        start = now()
        try:
            yield self
        finally:
            self.window = (start, now())
            for op, function in originals.items():
                setattr(dist, op, function)

    # ----- results ------------------------------------------------------------------------------
    def comm_spans(self) -> list[tuple[str, float, float, int]]:
        spans = list(self.sync_comms)
        for work in self.works:
            work.is_completed()
            spans.append((work.label, work.launched, work.completed or self.window[1], work.nbytes))
        return sorted(spans, key=lambda s: s[1])

    def compute_spans(self) -> list[tuple[str, float, float]]:
        """The window minus the blocked spans: what the main thread computed (Python included)."""
        spans, cursor = [], self.window[0]
        for _, start, end in sorted(self.main, key=lambda s: s[1]):
            if start > cursor:
                spans.append(("compute", cursor, start))
            cursor = max(cursor, end)
        if self.window[1] > cursor:
            spans.append(("compute", cursor, self.window[1]))
        return spans

    def summary(self) -> dict:
        """Totals for this rank, and the blocked time grouped by where the communication was issued."""
        start, end = self.window
        by_label = defaultdict(lambda: [0, 0.0])
        for label, s, e in self.main:
            by_label[label][0] += 1
            by_label[label][1] += e - s
        comm = self.comm_spans()
        return {"rank": self.rank, "step_s": end - start,
                "blocked_s": sum(e - s for _, s, e in self.main),
                "comm_in_flight_s": sum(e - s for _, s, e, _ in comm), "comm_ops": len(comm),
                "comm_bytes": sum(b for *_, b in comm),
                "blocked_by_label": {k: {"count": c, "seconds": t} for k, (c, t) in by_label.items()}}

    def chrome_events(self, origin: float = 0.0) -> list[dict]:
        """This rank's spans as Chrome trace events (microseconds from ``origin``)."""
        pid, events, threads = self.rank, [], {}

        def add(name, start, end, thread, **args):
            tid = threads.setdefault(thread, len(threads))
            events.append({"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": (start - origin) * 1e6,
                           "dur": max(end - start, 0.0) * 1e6, "args": args})

        for name, s, e in self.compute_spans():
            add(name, s, e, "main")
        for name, s, e in self.main:
            add(name, s, e, "main", blocked_ms=round((e - s) * 1e3, 3))
        for name, s, e in self.phases:
            add(name, s, e, "phase")
        lanes: list[float] = []  # end time of the last span in each lane
        for name, s, e, nbytes in self.comm_spans():
            lane = next((i for i, busy_until in enumerate(lanes) if busy_until <= s), None)
            if lane is None:
                lane = len(lanes)
                lanes.append(e)
            lanes[lane] = e
            add(name, s, e, f"comm {lane}", bytes=nbytes)
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}})
        events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread}}
                   for thread, tid in threads.items()]
        return events


def gather_trace(recorder: SpanRecorder, path: str | None) -> list[dict]:
    """Collective: every rank's summary to every rank; rank 0 writes the merged Chrome trace to ``path``."""
    mine = {"summary": recorder.summary(), "start": recorder.window[0],
            "events": recorder.chrome_events() if path else []}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if path and dist.get_rank() == 0:
        origin = min(item["start"] for item in everyone)
        events = []
        for item in everyone:
            for event in item["events"]:
                if "ts" in event:
                    event["ts"] -= origin * 1e6
                events.append(event)
        write_json(path, {"traceEvents": events, "displayTimeUnit": "ms"})
    return [item["summary"] for item in everyone]


def format_exposed(summaries: list[dict], top: int = 6) -> str:
    """Per rank: step, blocked time and the biggest sources of blocked (exposed) communication."""
    lines = []
    for s in summaries:
        lines.append(f"rank {s['rank']}: step {s['step_s'] * 1e3:.1f} ms, blocked on communication "
                     f"{s['blocked_s'] * 1e3:.1f} ms, {s['comm_ops']} ops in flight for "
                     f"{s['comm_in_flight_s'] * 1e3:.1f} ms ({s['comm_bytes'] / 2**20:.1f} MiB)")
        ranked = sorted(s["blocked_by_label"].items(), key=lambda kv: -kv[1]["seconds"])[:top]
        for label, value in ranked:
            lines.append(f"    {value['seconds'] * 1e3:8.1f} ms  x{value['count']:<3} {label}")
    return "\n".join(lines)


@contextlib.contextmanager
def tagged_backward(chunks):
    """Name the backward node that communicates for each column-parallel linear after its module and call
    ('layers.3.mlp.fc1 #1': the second call in the step, i.e. mu-chunk 1), so that backward communication
    is attributed to a layer; forward hooks only read the output's graph."""
    from megatron_domino.tensor_parallel import ColumnParallelLinear
    calls: dict[str, int] = defaultdict(int)

    def tag(name, _module, _inputs, output):
        label, calls[name] = f"{name} #{calls[name]}", calls[name] + 1
        nodes = [output.grad_fn] if torch.is_tensor(output) and output.grad_fn is not None else []
        for _ in range(4):  # the communicating node is within a few steps of the linear's output
            for node in nodes:
                if node.name() in _COMMUNICATING_NODES:
                    node.metadata.setdefault(_TAG, label)
            nodes = [n for node in nodes for n, _ in node.next_functions if n is not None]

    handles = [module.register_forward_hook(functools.partial(tag, chunk.global_name(name)))
               for chunk in chunks for name, module in chunk.named_modules()
               if isinstance(module, ColumnParallelLinear)]
    # The output head is a column-parallel product but no module: found from the last stage's loss, after
    # the layers' hooks have tagged theirs.
    handles += [chunk.register_forward_hook(functools.partial(tag, "output head"))
                for chunk in chunks if chunk.has_head]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def pipeline_ops(trainer, record):
    """Call ``record(instruction, start, end)`` for every forward, backward and W the trainer's pipeline runs."""
    executor = trainer.engine.executor
    forward, backward = executor._forward, executor._backward

    def timed_forward(instruction, *args):
        start = now()
        output = forward(instruction, *args)
        record(instruction, start, now())
        return output

    def timed_backward(instruction, *args):
        start = now()
        backward(instruction, *args)
        record(instruction, start, now())

    executor._forward, executor._backward = timed_forward, timed_backward
    try:
        yield
    finally:
        del executor._forward, executor._backward
