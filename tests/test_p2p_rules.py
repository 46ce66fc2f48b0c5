"""The pipeline transport under NCCL's rules, on 2 gloo ranks: the strict transport reproduces the hang NCCL
would have on the old one-transfer-at-a-time order, refuses transfers matched to the wrong tensor, and carries
the grouped schedules' data intact (plain transport and strict alike)."""
import pytest
import torch

from megatron_domino.pipeline.p2p import ACTIVATION, GRADIENT, P2P, P2PTimeout, Transfer
from megatron_domino.pipeline.program import Instruction, TransferGroup, transfers_of
from megatron_domino.pipeline.schedules import build_schedule
from megatron_domino.pipeline.strict_transport import StrictP2P
from tests.harness import run_ranks

SHAPE = (2, 16, 8)  # one micro-batch's activation


def _value(kind: int, microbatch: int) -> torch.Tensor:
    return torch.full(SHAPE, 100.0 * kind + microbatch)


def _transfer(inst, rank: int) -> Transfer:
    """A tensor that says what it is, sent or expected the way the executor does it (pp = 2, v = 1)."""
    kind = ACTIVATION if inst.op.endswith("forward") else GRADIENT
    peer = 1 - rank
    receiving_stage = peer if inst.op.startswith("send") else rank
    if inst.op.startswith("send"):
        return Transfer(peer, str(inst), (kind, inst.microbatch, receiving_stage), tensor=_value(kind, inst.microbatch))
    return Transfer(peer, str(inst), (kind, inst.microbatch, receiving_stage), shape=SHAPE, dtype=torch.float32)


def _drive(p2p, program, rank) -> int:
    """Walk a program's transfer groups (computes skipped); check every received tensor; count them."""
    received = 0
    for step in program:
        if not isinstance(step, TransferGroup):
            continue
        transfers = [_transfer(t, rank) for t in step.transfers]
        tensors = iter(p2p.exchange(transfers))
        for transfer in transfers:
            if not transfer.is_send:
                got = next(tensors)
                assert torch.equal(got, _value(transfer.key[0], transfer.key[1])), (rank, transfer.label)
                received += 1
    p2p.drain()
    return received


def _unbatched(program, rank):
    steps = []
    for inst in (s for s in program if s.is_compute):
        recvs, sends = transfers_of(inst, rank, 2)
        steps += [TransferGroup((t,)) for t in recvs] + [inst] + [TransferGroup((t,)) for t in sends]
    return steps


def _rules(rank, world_size):
    schedule = build_schedule("1f1b", 2, 4)[rank]
    counts = [_drive(P2P(torch.device("cpu"), 30), schedule, rank),
              _drive(StrictP2P(torch.device("cpu"), 30), schedule, rank),
              _drive(StrictP2P(torch.device("cpu"), 30, variable_shapes=True), schedule, rank),
              _drive(P2P(torch.device("cpu"), 30), _unbatched(schedule, rank), rank)]  # gloo forgives the old order
    # Rank 0 sends activation 1 where rank 1 waits for activation 0: refused before any data moves.
    wrong = [TransferGroup((Instruction("send_forward", 1) if rank == 0 else Instruction("recv_forward", 0),))]
    try:
        _drive(StrictP2P(torch.device("cpu"), 3), wrong, rank)
    except (RuntimeError, P2PTimeout) as error:
        return counts, str(error)
    return counts, None


def _old_order(rank, world_size):
    try:
        _drive(StrictP2P(torch.device("cpu"), 3), _unbatched(build_schedule("1f1b", 2, 4)[rank], rank), rank)
    except P2PTimeout as error:
        return str(error)
    return None


def test_strict_transport_carries_grouped_schedules_and_refuses_the_wrong_tensor():
    (counts0, mismatch), (counts1, starved) = run_ranks(_rules, 2, timeout=120)
    assert counts0 == [4] * 4 and counts1 == [4] * 4  # 4 gradients into stage 0, 4 activations into stage 1
    assert "order mismatch" in mismatch and "sends activation of micro-batch 1 for stage 1" in mismatch
    assert "expects activation of micro-batch 0 for stage 1" in mismatch
    assert "receive of rF0 from rank 0" in starved


@pytest.mark.slow
def test_strict_transport_hangs_on_the_old_order_where_nccl_would():
    """The issue's trace at pp 2, m 4: rank 0 blocks sending activation 1, rank 1 blocks sending gradient 0."""
    hang0, hang1 = run_ranks(_old_order, 2, timeout=60)
    assert "send of sF1 to rank 1" in hang0 and "would block forever" in hang0
    assert "send of sB0 to rank 0" in hang1 and "would block forever" in hang1


def _group_is_one_work(rank, world_size):
    """The strict transport answers a group as NCCL does, with ONE work however many transfers it holds, and
    the plain transport built on it still hands every receive its tensor (the old pairing of works with
    transfers lost all but the first)."""
    class Recording(StrictP2P):
        def _launch(self, transfers, buffers):
            works = super()._launch(transfers, buffers)
            self.returned.append((len(transfers), len(works)))
            return works

    p2p = Recording(torch.device("cpu"), 30)
    p2p.returned = []
    received = _drive(p2p, build_schedule("1f1b", 2, 4)[rank], rank)
    return received, p2p.returned


def test_strict_transport_returns_one_work_per_group_as_nccl_does():
    for received, returned in run_ranks(_group_is_one_work, 2, timeout=60):
        assert received == 4
        assert any(transfers > 1 for transfers, _ in returned) and all(works == 1 for _, works in returned), returned


def _group_completes_whole(rank, world_size):
    """Rank 1 posts one group of two receives and waits for the first; rank 0 sends the first at once and the
    second only when rank 1 says its wait is still blocked."""
    import threading
    blocked = {}
    for name, p2p in (("plain", P2P(torch.device("cpu"), 30)), ("strict", StrictP2P(torch.device("cpu"), 30))):
        first = Transfer(1 - rank, "first", (ACTIVATION, 0, 1), tensor=_value(ACTIVATION, 0) if rank == 0 else None,
                         shape=None if rank == 0 else SHAPE, dtype=torch.float32)
        second = Transfer(1 - rank, "second", (ACTIVATION, 1, 1), tensor=_value(ACTIVATION, 1) if rank == 0 else None,
                          shape=None if rank == 0 else SHAPE, dtype=torch.float32)
        flag = torch.zeros(1)
        if rank == 0:
            p2p.post([first])
            torch.distributed.recv(flag, 1, tag=7)  # rank 1: the first receive's wait has not returned
            p2p.post([second])
        else:
            early, late = p2p.post([first, second])  # returns at once: nothing is waited for at issue
            got = {}
            waiter = threading.Thread(target=lambda: got.setdefault("first", early.wait()))
            waiter.start()
            waiter.join(timeout=1.0)
            blocked[name] = waiter.is_alive()
            torch.distributed.send(flag, 0, tag=7)
            waiter.join(timeout=30)
            assert torch.equal(got["first"], _value(ACTIVATION, 0)) and torch.equal(late.wait(), _value(ACTIVATION, 1))
        p2p.drain()
    return blocked


def test_a_group_completes_as_a_whole_as_on_nccl():
    """Waiting for a group's first receive waits for all of it (NCCL completes a group as one work), on both
    transports. So a schedule must never make a group's later transfer depend on the use of an earlier one:
    on NCCL that deadlocks. The simulator holds every schedule to the stricter rule (a rank waits for a whole
    group when it posts it), so the schedules are safe; the transports wait only when a tensor is needed."""
    _, blocked = run_ranks(_group_completes_whole, 2, timeout=90)
    assert blocked == {"plain": True, "strict": True}
