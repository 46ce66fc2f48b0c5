"""Micro-batches reach the device one at a time: the one read and the next (prefetched), at most ``keep`` held."""
import torch

from megatron_domino.pipeline.device_batches import DeviceBatches


def _host(n):
    return [{"tokens": torch.full((2, 4), i), "labels": torch.full((2, 4), -i)} for i in range(n)]


def test_a_read_copies_that_batch_and_the_next_and_holds_at_most_keep():
    host = _host(5)
    batches = DeviceBatches(host, torch.device("cpu"), keep=2)
    assert len(batches) == 5 and list(batches._on_device) == []  # nothing moves before the schedule reads
    for i in range(5):
        batch = batches[i]
        assert torch.equal(batch["tokens"], host[i]["tokens"]) and torch.equal(batch["labels"], host[i]["labels"])
        assert list(batches._on_device) == ([i, i + 1] if i < 4 else [3, 4])
    assert torch.equal(batches[0]["tokens"], host[0]["tokens"])  # an evicted one (interleaving) comes back
    assert list(batches._on_device) == [0, 1]


def _stream_order():
    """DeviceBatches on a fake cuda device, its stream calls recorded through the device seam."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_domino.parallel import device
    from megatron_domino.rehearsal import fake_cuda
    from megatron_domino.rehearsal.collectives import CollectiveCounter
    from megatron_domino.rehearsal.dispatch import RehearsalMode
    from megatron_domino.rehearsal.host_syncs import HostSyncDetector
    from megatron_domino.rehearsal.memory import AllocationAccounting
    from megatron_domino.rehearsal.runtime import FakeEvent, FakeStream, RehearsalRuntime
    log = []

    class Stream(FakeStream):
        def wait_event(self, event):
            log.append(f"{self.name} waits for {event.name}")

        def wait_stream(self, other):
            log.append(f"{self.name} waits for all of {other.name}")

        def record_event(self, event=None):
            event = FakeEvent(self._runtime)
            event.name = f"copy {sum(entry.startswith('record') for entry in log)}"
            log.append(f"record {event.name} on {self.name}")
            return event

    class Runtime(RehearsalRuntime):
        def Stream(self, device=None):  # noqa: N802
            return Stream(self, torch.device("cuda", 0), "side")

        def current_stream(self, device=None):
            return Stream(self, torch.device("cuda", 0), "compute")

    syncs, memory = HostSyncDetector(), AllocationAccounting()
    previous = device.install(Runtime(fake_cuda.library(), syncs, memory, "fake", (9, 0)))
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), RehearsalMode(memory, syncs, CollectiveCounter()):
            batches = DeviceBatches(_host(3), torch.device("cuda", 0))
            devices = [str(batches[i]["tokens"].device) for i in range(3)]
    finally:
        device.install(previous)
    return devices, log


def test_the_compute_waits_for_its_own_batch_copy_not_for_the_prefetch():
    """On CUDA the copy of batch i + 1 is queued on the side stream after batch i's: the compute stream waits for
    the event recorded after i's copy only, so i + 1's copy overlaps i's compute (waiting for the side stream as
    a whole would wait for the prefetch too)."""
    from tests.fake_cuda import on_fake_cuda
    devices, log = on_fake_cuda("tests.test_device_batches:_stream_order")
    assert devices == ["cuda:0"] * 3
    assert log == ["record copy 0 on side", "compute waits for copy 0", "record copy 1 on side",
                   "compute waits for copy 1", "record copy 2 on side", "compute waits for copy 2"], log
