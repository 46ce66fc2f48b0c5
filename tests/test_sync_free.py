"""Pieces of a step that must not wait for the device, each on the fake CUDA device under the rehearsal's dispatch
mode (quick; tests/test_rehearsal.py checks whole steps): routing under capacity (every drop policy), the shape
header a variable-length pipeline transfer sends, and the device check at collectives, which refuses a host
tensor where gloo would take it."""
import pytest

from tests.fake_cuda import on_fake_cuda

pytestmark = pytest.mark.quick


CASES = ("routing", "header", "device tensor", "host tensor")


def _steady(cases: list) -> dict:
    """In a fake-CUDA child: each case run as a steady-state step would; the host syncs found and the error raised."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_domino.models.router import route
    from megatron_domino.pipeline.p2p import P2P
    from megatron_domino.rehearsal.collectives import CollectiveCounter
    from megatron_domino.rehearsal.dispatch import RehearsalMode
    from megatron_domino.rehearsal.host_syncs import HostSyncDetector
    from megatron_domino.rehearsal.memory import AllocationAccounting
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    results = {}
    for case in cases:
        syncs, error = HostSyncDetector(), None
        with FakeTensorMode(allow_non_fake_inputs=True), RehearsalMode(AllocationAccounting(), syncs,
                                                                       CollectiveCounter()):
            logits = torch.randn(40, 8, device="cuda:0")
            syncs.steady = True
            try:
                if case == "routing":
                    for policy in ("position", "probs", "random"):
                        route(logits, 2, "softmax", 0.5, drop_policy=policy)
                elif case == "header":
                    P2P(torch.device("cuda", 0), 30, variable_shapes=True)._header((2, 16, 32))
                else:
                    dist.all_reduce(logits if case == "device tensor" else torch.ones(3))
            except RuntimeError as raised:
                error = str(raised)
        results[case] = {"syncs": [str(s) for s in syncs.found], "error": error}
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def steady():
    return on_fake_cuda("tests.test_sync_free:_steady", list(CASES))


def test_routing_under_capacity_reads_nothing(steady):
    """The capacity queue's counts by a scatter-add: bincount would read its output size on the host."""
    assert steady["routing"] == {"syncs": [], "error": None}


def test_a_shape_header_is_sent_without_a_host_sync(steady):
    """parallel.variable_seq_lengths: written in page-locked host memory, one non-blocking copy to the device."""
    assert steady["header"] == {"syncs": [], "error": None}


def test_the_rehearsal_refuses_a_host_tensor_at_a_collective(steady):
    assert steady["device tensor"] == {"syncs": [], "error": None}
    refused = steady["host tensor"]["error"]
    assert refused and "was given a cpu tensor of shape (3,): an NCCL group takes CUDA tensors only" in refused
