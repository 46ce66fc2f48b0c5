"""The timed process group (megatron_domino/rehearsal/timed_group.py): one process plays rank r, and each operation
completes after the link model's time, on its channel's clock.

On the CPU a virtual clock stands in for the host's (``HostClock(now, sleep)``), so completion times are exact:
they are checked against the formula of the issue written out here (latency + steps x hop + bytes x factor /
bandwidth), not against the model's code. The CUDA path runs on the fake CUDA device with a recording runtime:
the operation is ordered after the caller's stream by an event, runs on a stream of the group's own, and
``Work.wait`` makes the current stream wait, never the host."""
import time

import pytest
import torch
import torch.distributed as dist

from megatron_domino.config.errors import ConfigError
from megatron_domino.rehearsal.link_clocks import Exposure, HostClock
from megatron_domino.rehearsal.links import Link, LinkModel
from megatron_domino.rehearsal.store import RehearsalStore
from megatron_domino.rehearsal.timed_group import TimedJob, backend_name, register
from tests.fake_cuda import on_fake_cuda

GB, US = 1e9, 1e-6


class VirtualClock:
    def __init__(self):
        self.t, self.slept = 0.0, 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds
        self.slept += seconds


@pytest.fixture
def world():
    """Rank 3 of 16 on the CPU, 2 nodes of 8: links 100 GB/s + 2 us + 1 us a step inside, 10 GB/s + 5 us across."""
    register()
    clock = VirtualClock()
    links = LinkModel(Link("node", 100.0, 2.0, 1.0), Link("network", 10.0, 5.0), 8)
    exposure = Exposure()
    job = TimedJob(links, torch.device("cpu"), exposure, HostClock(exposure, clock.now, clock.sleep))
    dist.init_process_group(backend_name(job.device), store=RehearsalStore(16, {}), rank=3, world_size=16,
                            pg_options=job)
    try:
        yield clock, job, dist.new_group([0, 1, 2, 3]), dist.new_group([3, 11])
    finally:
        dist.destroy_process_group()


def _finish(clock, work) -> float:
    """Wait for ``work`` at the current virtual time; the time it completed."""
    assert not work.is_completed()
    work.wait()
    assert work.is_completed()
    return clock.t


def test_each_operation_completes_after_latency_steps_and_bytes_over_bandwidth(world):
    clock, job, node, pair = world
    x = torch.ones(1000)  # 4,000 bytes
    cases = [  # (issue, expected seconds): node group of 4 = 100 GB/s, 2 us + 1 us per ring step
        (lambda: dist.all_reduce(x, group=node, async_op=True), 2 * US + 6 * US + 4000 * 2 * 3 / 4 / (100 * GB)),
        (lambda: dist.all_gather_into_tensor(torch.empty(4000), x, group=node, async_op=True),
         2 * US + 3 * US + 16000 * 3 / 4 / (100 * GB)),
        (lambda: dist.reduce_scatter_tensor(torch.empty(250), x, group=node, async_op=True),
         2 * US + 3 * US + 4000 * 3 / 4 / (100 * GB)),
        (lambda: dist.all_to_all_single(torch.empty(1000), x, group=node, async_op=True),
         2 * US + 3 * US + 4000 * 3 / 4 / (100 * GB)),
        (lambda: dist.broadcast(x, src=0, group=node, async_op=True), 2 * US + 3 * US + 4000 / (100 * GB)),
        # ranks 3 and 11 sit on two nodes: the network, 10 GB/s + 5 us, no step term
        (lambda: dist.all_reduce(x, group=pair, async_op=True), 5 * US + 4000 * 2 * 1 / 2 / (10 * GB)),
        (lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 11)])[0], 5 * US + 4000 / (10 * GB)),
        (lambda: dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.empty(1000), 2)])[0],
         2 * US + 1 * US + 4000 / (100 * GB)),
    ]
    for issue, expected in cases:
        start = clock.t
        assert _finish(clock, issue()) - start == pytest.approx(expected, rel=1e-9)


def test_a_groups_operations_queue_in_issue_order_and_other_channels_do_not_wait(world):
    clock, job, node, pair = world
    big, small = torch.ones(2_500_000), torch.ones(10)  # 10 MB: 158 us on the node's ring of 4
    ring = 2 * US + 6 * US + big.numel() * 4 * 1.5 / (100 * GB)
    transfer = 2 * US + 1 * US + big.numel() * 4 / (100 * GB)
    works = [dist.all_reduce(big, group=node, async_op=True),
             dist.all_reduce(big.clone(), group=node, async_op=True),  # starts when the first ends
             dist.all_reduce(small, group=pair, async_op=True),  # another group: a channel of its own
             dist.batch_isend_irecv([dist.P2POp(dist.isend, big, 2)])[0],
             dist.batch_isend_irecv([dist.P2POp(dist.irecv, big.clone(), 2)])[0],  # the other direction: beside it
             dist.batch_isend_irecv([dist.P2POp(dist.isend, big, 2)])[0]]  # behind the first send to rank 2
    ends = [work.operation.end for work in works]
    assert ends == pytest.approx([ring, 2 * ring, 5 * US + 40 / (10 * GB), transfer, transfer, 2 * transfer])
    for work in works:
        work.wait()
    assert clock.t == pytest.approx(2 * ring)
    modelled, exposed, counts = job.exposure.take()
    assert modelled[node.group_name] == pytest.approx(2 * ring)
    assert exposed[node.group_name] == pytest.approx(2 * ring)  # the host slept through both
    assert sum(exposed.values()) == pytest.approx(2 * ring)  # ... and waited for nothing else: done by then
    assert counts[node.group_name] == [2, 2 * big.numel() * 4]


def test_values_are_what_every_rank_holding_this_ranks_tensors_would_give(world):
    clock, job, node, pair = world
    x = torch.arange(4.0)
    dist.all_reduce(x, group=node)
    assert x.tolist() == [0.0, 4.0, 8.0, 12.0]  # summed over 4 equal members
    dist.all_reduce(x, op=dist.ReduceOp.AVG, group=node)
    assert x.tolist() == [0.0, 4.0, 8.0, 12.0]
    gathered = torch.empty(8)
    dist.all_gather_into_tensor(gathered, torch.tensor([1.0, 2.0]), group=node)
    assert gathered.tolist() == [1.0, 2.0] * 4
    scattered = torch.empty(2)
    dist.reduce_scatter_tensor(scattered, torch.arange(8.0), group=node)  # rank 3 of the group: its chunk, x 4
    assert scattered.tolist() == [24.0, 28.0]
    exchanged = torch.empty(5)
    dist.all_to_all_single(exchanged, torch.arange(4.0), [2, 1, 1, 1], [1, 1, 1, 1], group=node)
    assert exchanged.tolist() == [0.0, 0.0, 1.0, 2.0, 3.0]  # chunk j from this rank's chunk j, repeated to fit
    sent, received = torch.tensor([5.0, 6.0]), torch.empty(2)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, 4), dist.P2POp(dist.irecv, received, 2)]):
        work.wait()
    assert received.tolist() == [5.0, 6.0]  # what this rank sends, as its neighbour runs the same program
    hosts = [None] * 4
    dist.all_gather_object(hosts, "this host", group=node)
    assert hosts == ["this host"] * 4


def test_a_host_blocked_on_the_timed_group_uses_no_core():
    register()
    job = TimedJob(LinkModel.parse("1e-5,0"), torch.device("cpu"))  # 10 kB/s: 4 kB takes 0.4 s
    dist.init_process_group(backend_name(job.device), store=RehearsalStore(2, {}), rank=0, world_size=2,
                            pg_options=job)
    try:
        work = dist.all_reduce(torch.ones(1000), async_op=True)  # small: no thread pool spinning after it
        wall, cpu = time.perf_counter(), time.process_time()
        work.wait()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        dist.destroy_process_group()
    assert wall >= 0.39
    assert cpu < 0.02 * wall  # < 2% of a core while blocked


def test_the_group_refuses_what_nccl_refuses_and_a_bad_link_names_the_fix(world):
    clock, job, node, pair = world
    meta = torch.empty(4, device="meta")
    with pytest.raises(RuntimeError, match="meta tensor .* on a group of cpu tensors"):
        node.allreduce([meta], dist.AllreduceOptions())  # the group itself, below the test suite's strict checks
    for bad in ("nvlink5", "0,3", "fast", "450"):
        with pytest.raises(ConfigError, match=r"--link = .*not a link.*Fix: e\.g\. --link nvlink4"):
            LinkModel.parse(bad)
    with pytest.raises(ConfigError, match="--gpus-per-node = 0: must be at least 1"):
        LinkModel.parse("nvlink4", gpus_per_node=0)


def _cuda_order():
    """In the child (fake CUDA): the CUDA clock's calls, in order, around one all-reduce and its wait."""
    import itertools

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_domino.parallel import device as door
    from megatron_domino.rehearsal import fake_cuda
    from megatron_domino.rehearsal.link_clocks import Exposure, StreamClock
    from megatron_domino.rehearsal.links import LinkModel
    from megatron_domino.rehearsal.runtime import FakeEvent, FakeStream, RehearsalRuntime
    from megatron_domino.rehearsal.store import RehearsalStore
    from megatron_domino.rehearsal.timed_group import TimedJob, backend_name, register
    log = []

    made = itertools.count()

    class Event(FakeEvent):
        def __init__(self, runtime):
            super().__init__(runtime)
            self.tag = f"e{next(made)}"

        def record(self, stream=None):
            log.append(("record", self.tag, stream.name))

    class Stream(FakeStream):
        def wait_event(self, event):
            log.append(("wait_event", self.name, event.tag))

    class Runtime(RehearsalRuntime):
        def Event(self, enable_timing=False):  # noqa: N802
            return Event(self)

        def Stream(self, device=None):  # noqa: N802
            return Stream(self, torch.device("cuda", 0), "comm")

        def current_stream(self, device=None):
            current = super().current_stream(device)
            return Stream(self, current.device, current.name) if type(current) is FakeStream else current

        def synchronize(self, device=None):
            log.append(("HOST SYNC",))

    class Kernel:
        def stamp(self, stream):
            log.append(("stamp", door.cuda.current_stream().name))
            return "start"

        def hold(self, stream, start, seconds, sms):
            log.append(("hold", door.cuda.current_stream().name, start, round(seconds * 1e6, 3), sms))

    runtime = Runtime(fake_cuda.library(), None, None, "fake", (9, 0))
    previous = door.install(runtime)
    register()
    exposure, device = Exposure(), torch.device("cuda", 0)
    job = TimedJob(LinkModel.parse("nvlink4"), device, exposure, StreamClock(exposure, device, Kernel()))
    dist.init_process_group(backend_name(device), store=RehearsalStore(8, {}), rank=0, world_size=8, pg_options=job)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.ones(1 << 20, device=device)  # 4 MiB
            work = dist.all_reduce(x, async_op=True)
            log.append(("issued",))
            work.wait()
            log.append(("waited",))
            dist.all_reduce(x)  # async_op=False: the stream waits too, the host does not
            try:
                dist.all_reduce(torch.ones(4))
            except RuntimeError as error:
                log.append(("refused", "cpu tensor" in str(error)))
    finally:
        dist.destroy_process_group()
        door.install(previous)
    return log


def test_on_cuda_an_operation_runs_on_its_groups_stream_and_wait_never_blocks_the_host():
    log = on_fake_cuda("tests.test_timed_group:_cuda_order")
    ring = 1e6 * (8.4e-6 + 14 * 3.4e-6 + (1 << 22) * 2 * 7 / 8 / 450e9)
    one_operation = [["record", "e0", "default"], ["wait_event", "comm", "e0"], ["stamp", "comm"],
                     ["hold", "comm", "start", round(ring, 3), 16], ["record", "e1", "comm"]]
    assert log[:5] == one_operation
    assert log[5:9] == [["issued"], ["record", "e2", "default"], ["wait_event", "default", "e1"],
                        ["record", "e3", "default"]]
    assert log[9] == ["waited"]
    assert [entry[0] for entry in log[10:]] == ["record", "wait_event", "stamp", "hold", "record", "record",
                                                 "wait_event", "record", "refused"]
    assert log[-1] == ["refused", True]
    assert ["HOST SYNC"] not in log


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs it)")
def test_on_a_gpu_an_operation_lasts_its_modelled_time_and_its_wait_leaves_the_host_free():
    register()
    device = torch.device("cuda", 0)
    job = TimedJob(LinkModel.parse("1,10"), device)  # 1 GB/s: an all-reduce of 16 MiB over 2 ranks, 16.8 ms
    store = RehearsalStore(2, {})
    dist.init_process_group(backend_name(device), store=store, rank=0, world_size=2, pg_options=job)
    try:
        x = torch.ones(1 << 22, device=device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        work = dist.all_reduce(x, async_op=True)
        host = time.perf_counter()
        work.wait()
        host = time.perf_counter() - host
        end.record()
        torch.cuda.synchronize()
        elapsed = start.elapsed_time(end) / 1e3
    finally:
        dist.destroy_process_group()
    expected = 10 * US + (1 << 24) * 2 * 1 / 2 / (1 * GB)
    assert job.clock.kernel.kind == "nvrtc", job.clock.kernel.kind
    assert expected <= elapsed <= 1.1 * expected + 1e-3, (elapsed, expected)
    assert host < expected / 4, host  # the stream waited, not the host
    assert x[0].item() == 2.0
