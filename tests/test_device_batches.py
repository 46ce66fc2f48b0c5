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
