"""A torch.distributed backend whose operations take the time a real link would: one process plays rank r.

``dist.init_process_group(backend_name(device), rank=r, world_size=n, store=..., pg_options=TimedJob(...))``
makes rank r of an n-rank job, alone in this process; ``dist.new_group`` then makes its groups as usual (they
share the default group's ``TimedJob``). Each operation the library or megatron-core issues (all-reduce,
reduce-scatter, all-gather, all-to-all, broadcast, barrier, reduce, and the sends and receives of
``batch_isend_irecv``) writes plausible values and completes after the link model's time (``links.LinkModel``)
on its channel's clock (``link_clocks``): on the CPU a deadline, on CUDA a kernel on a stream of the group's
own. A group serves its device's tensors only (``backend_name``), as NCCL serves CUDA's.

Values (only time and memory are claimed, never numbers): an all-reduce leaves what every rank holding this
rank's tensor would give (SUM: n times it), an all-gather replicates the local shard, a reduce-scatter keeps
this rank's chunk (SUM: n times it), an all-to-all keeps what this rank sends (its chunks in place where the
sizes agree, else its bytes repeated), a broadcast keeps the tensor, a receive gets a copy of the last tensor of
that shape and dtype this rank sent (before any, draws from a generator of its own). Channels: a group's
collectives run one after another, as on NCCL's one stream per group; point-to-point transfers run per peer
and direction, sends beside receives. ``batch_isend_irecv`` returns a work per transfer, as on gloo (a Python
group cannot coalesce); the pipeline waits for all of them, which is what NCCL's one work means.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .link_clocks import Exposure, HostClock, StreamClock
from .links import LinkModel

DEVICES = ("cpu", "cuda")  # a backend per device type, so a group serves one, as NCCL serves CUDA alone


def backend_name(device: torch.device) -> str:
    """The timed backend serving ``device``'s tensors ("timed_cpu", "timed_cuda")."""
    return f"timed_{device.type}"


@dataclass
class TimedJob:
    """What all timed groups of this process share: the link model, this rank's device and the clocks."""

    links: LinkModel
    device: torch.device
    exposure: Exposure = field(default_factory=Exposure)
    clock: object = None  # HostClock or StreamClock; made from ``device`` when None
    sent: dict = field(default_factory=dict)  # (shape, dtype) -> the last tensor of that kind sent

    def __post_init__(self):
        if self.clock is None:
            if self.device.type == "cuda":
                from .link_kernel import LinkKernel
                self.clock = StreamClock(self.exposure, self.device, LinkKernel(self.device))
            else:
                self.clock = HostClock(self.exposure)
        self._generator = None

    def noise(self, like: torch.Tensor) -> None:
        """Fill ``like`` with a seeded draw that leaves the default generators alone."""
        if self._generator is None:
            self._generator = torch.Generator(device=like.device).manual_seed(0)
        if like.is_floating_point():
            like.normal_(generator=self._generator)
        else:
            like.zero_()


class TimedWork(dist.Work):
    def __init__(self, operation):
        super().__init__()
        self.operation = operation

    def wait(self, timeout=None) -> bool:
        self.operation.wait()
        return True

    def is_completed(self) -> bool:
        return self.operation.done()

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def synchronize(self) -> None:
        self.operation.wait()


def _size(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _summed(op) -> bool:
    return op == dist.ReduceOp.SUM or op == dist.ReduceOp.PREMUL_SUM  # a ReduceOp is no member of a tuple of types


def _fill(out: torch.Tensor, source: torch.Tensor) -> None:
    """``out`` gets ``source``'s values in order, repeated or cut to fit (zeros from an empty source)."""
    flat, src = out.reshape(-1), source.reshape(-1).to(out.dtype)
    if src.numel() == 0:
        out.zero_()
    elif src.numel() == flat.numel():
        out.copy_(src.view(out.shape))
    else:
        reps = -(-flat.numel() // src.numel())
        out.copy_(src.repeat(reps)[:flat.numel()].view(out.shape))


class TimedProcessGroup(dist.ProcessGroup):
    def __init__(self, job: TimedJob, rank: int, size: int, global_ranks: list[int]):
        super().__init__(rank, size)
        self.job, self.global_ranks, self._name = job, list(global_ranks), ""

    # torch names a group after creating it; a Python group keeps the name itself
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return backend_name(self.job.device)

    def _run(self, op: str, tensors, nbytes: int, apply, channel=None, key=None, ranks=None) -> TimedWork:
        for tensor in tensors:  # as NCCL: a group serves its device's tensors only
            if tensor.device.type != self.job.device.type:
                raise RuntimeError(f"timed group {self._name!r} ({op}): a {tensor.device.type} tensor of shape "
                                   f"{tuple(tensor.shape)} on a group of {self.job.device.type} tensors (NCCL: no "
                                   f"backend for device type {tensor.device.type}). Fix: move it to "
                                   f"{self.job.device} first")
        ranks = self.global_ranks if ranks is None else ranks
        seconds = self.job.links.seconds(op, nbytes, ranks)
        key = self._name if key is None else key
        self.job.exposure.issued(key, seconds, nbytes)
        clock = self.job.clock
        extra = {"sms": self.job.links.link_for(ranks).sms} if isinstance(clock, StreamClock) else {}
        return TimedWork(clock.run(channel or ("group", self._name), key, seconds, apply, tensors, **extra))

    # ----- collectives -------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        n, summed = self.size(), opts is None or _summed(opts.reduceOp)
        return self._run("all_reduce", tensors, _size(tensors),
                         lambda: [t.mul_(n) for t in tensors] if summed and n > 1 else None)

    allreduce_coalesced = allreduce

    def reduce(self, tensors, opts=None):
        return self._run("all_reduce", tensors, _size(tensors), lambda: None)

    def all_gather_single(self, output, input, opts=None):  # noqa: A002 - torch's names
        return self._run("all_gather", (output, input), _size([output]),
                         lambda: output.view(self.size(), -1).copy_(input.reshape(1, -1).expand(self.size(), -1)))

    _allgather_base = all_gather_single  # torch < 2.12 calls it by this name

    def allgather(self, output_lists, inputs, opts=None):
        outs = [o for outputs in output_lists for o in outputs]
        return self._run("all_gather", outs + list(inputs), _size(outs),
                         lambda: [o.copy_(i) for outputs, i in zip(output_lists, inputs) for o in outputs])

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002
        n, summed = self.size(), opts is None or _summed(opts.reduceOp)

        def apply():
            output.view(-1).copy_(input.reshape(n, -1)[self.rank()])
            if summed:
                output.mul_(n)
        return self._run("reduce_scatter", (output, input), _size([input]), apply)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs, input_lists, opts=None):
        n, summed = self.size(), opts is None or _summed(opts.reduceOp)

        def apply():
            for out, pieces in zip(outputs, input_lists):
                out.copy_(pieces[self.rank()])
                if summed:
                    out.mul_(n)
        return self._run("reduce_scatter", list(outputs), sum(_size(p) for p in input_lists), apply)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):  # noqa: A002
        return self._run("all_to_all", (output, input), max(_size([output]), _size([input])),
                         lambda: _exchange_in_place(output, input, output_split_sizes, input_split_sizes))

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        return self._run("all_to_all", list(outputs) + list(inputs), max(_size(outputs), _size(inputs)),
                         lambda: [_fill(o, i) for o, i in zip(outputs, inputs)])

    def broadcast(self, tensors, opts=None):
        return self._run("broadcast", tensors, _size(tensors), lambda: None)

    def barrier(self, opts=None):
        return self._run("barrier", (), 0, lambda: None)

    def gather(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def scatter(self, outputs, input_lists, opts=None):
        return self._run("broadcast", list(outputs), _size(outputs),
                         lambda: [_fill(o, (pieces or [o])[self.rank()]) for o, pieces in zip(outputs, input_lists)])

    # ----- point to point ----------------------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        peer = self.global_ranks[dst]

        def apply():
            for t in tensors:
                kind = (tuple(t.shape), t.dtype)
                kept = self.job.sent.get(kind)
                if kept is None:
                    self.job.sent[kind] = kept = torch.empty_like(t)
                kept.copy_(t)
        return self._p2p("send", peer, tensors, apply)

    def recv(self, tensors, src: int, tag: int = 0):
        peer = self.global_ranks[src]

        def apply():
            for t in tensors:
                kept = self.job.sent.get((tuple(t.shape), t.dtype))
                t.copy_(kept) if kept is not None else self.job.noise(t)
        return self._p2p("recv", peer, tensors, apply)

    def _p2p(self, direction: str, peer: int, tensors, apply) -> TimedWork:
        me = self.global_ranks[self.rank()]
        return self._run("p2p", tensors, _size(tensors), apply, channel=(direction, peer), key=("peer", peer),
                         ranks=[me, peer])


def _exchange_in_place(output, input, output_splits, input_splits) -> None:  # noqa: A002
    """What this rank would receive if every peer sent as it does: chunk j of ``output`` from chunk j of
    ``input`` (rows repeated or cut when the sizes differ)."""
    if not output_splits and not input_splits:
        _fill(output, input)
        return
    n = len(output_splits or input_splits)
    outs = output.split(list(output_splits) if output_splits else [output.shape[0] // n] * n)
    ins = input.split(list(input_splits) if input_splits else [input.shape[0] // n] * n)
    for out, source in zip(outs, ins):
        _fill(out, source if source.numel() else input)


def _create(options, job: TimedJob | None):
    """torch's backend hook (extended API): the default group gets the ``TimedJob`` as its ``pg_options``, every
    later group the default group's."""
    if job is None:
        world = dist.distributed_c10d.GroupMember.WORLD
        if not isinstance(world, TimedProcessGroup):
            raise RuntimeError("a timed group needs the default group first: init_process_group(backend_name("
                               "device), pg_options=TimedJob(...))")
        job = world.job
    ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
    return TimedProcessGroup(job, options.group_rank, options.group_size, ranks)


def register() -> None:
    """Make the timed backends torch.distributed backends (once per process)."""
    for device in DEVICES:
        name = f"timed_{device}"
        if name.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(name, _create, extended_api=True, devices=[device])
