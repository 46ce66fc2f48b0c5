"""Ring attention against dense masked attention on one process, and its transfers against NCCL's p2p rules.

Every rank builds the same full q, k, v; the reference is SDPA over the whole sequence with an explicit
causal (and document) mask. Each CP rank feeds its two chunks to the ring and must get back exactly those
rows of the reference output and of the reference gradients of q, k and v.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_domino.models.ring_attention import Ring, chunk_starts, local_positions, ring_attention
from tests.harness import run_ranks

BATCH, HEADS, GROUPS, SEQ, DIM = 2, 4, 2, 32, 8


def _documents(seed: int) -> torch.Tensor:
    """Random layouts, padded by repeating L: one long document spanning chunks, many short ones, one whole row."""
    generator = torch.Generator().manual_seed(seed)
    rows = [[0, int(torch.randint(9, 24, (), generator=generator)), SEQ],
            sorted({0, SEQ, *torch.randint(1, SEQ, (7,), generator=generator).tolist()}),
            [0, SEQ]]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [SEQ] * (width - len(r)) for r in rows], dtype=torch.int32)


def _reference(q, k, v, doc_offsets, grad):
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril().expand(q.shape[0], 1, SEQ, SEQ).clone()
    if doc_offsets is not None:
        document = torch.zeros(q.shape[0], SEQ, dtype=torch.long)
        for row, offsets in enumerate(doc_offsets.tolist()):
            for index, (start, end) in enumerate(zip(offsets, offsets[1:])):
                document[row, start:end] = index
        allowed &= (document[:, :, None] == document[:, None, :]).unsqueeze(1)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=allowed, enable_gqa=True)
    return out.detach(), torch.autograd.grad(out, leaves, grad)


def _record_transfers(original, log: list):
    """Wrap batch_isend_irecv to log (send|recv, peer, shape) per call, in issue order."""

    def recording(ops):
        log.append([("send" if op.op is dist.isend else "recv", op.peer, tuple(op.tensor.shape)) for op in ops])
        return original(ops)
    return recording


def _check_rings(rank, world_size):
    rings = {2: [[0, 1], [2, 3]], 4: [[0, 1, 2, 3]]}
    groups = {cp: [dist.new_group(m) for m in members] for cp, members in rings.items()}
    logs = {}
    for cp, members in rings.items():
        index = next(i for i, m in enumerate(members) if rank in m)
        ring = Ring(groups[cp][index], members[index].index(rank), cp)
        mine = local_positions(SEQ, cp, ring.rank)
        for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
            for seed, docs in enumerate((None, _documents(7), _documents(8))):
                batch = BATCH if docs is None else docs.shape[0]
                generator = torch.Generator().manual_seed(100 + seed)
                q, k, v, grad = (torch.randn(batch, heads, SEQ, DIM, generator=generator, dtype=dtype)
                                 for heads in (HEADS, GROUPS, GROUPS, HEADS))
                want, want_grads = _reference(q, k, v, docs, grad)
                leaves = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
                original = dist.batch_isend_irecv
                dist.batch_isend_irecv = _record_transfers(original, logs.setdefault((cp, str(dtype), seed), []))
                try:
                    out = ring_attention(*leaves, ring, docs)
                    got_grads = torch.autograd.grad(out, leaves, grad[:, :, mine])
                finally:
                    dist.batch_isend_irecv = original
                torch.testing.assert_close(out, want[:, :, mine], rtol=tolerance, atol=tolerance)
                for got, expected in zip(got_grads, want_grads):
                    torch.testing.assert_close(got, expected[:, :, mine], rtol=tolerance, atol=tolerance)
    return logs


def test_ring_attention_equals_dense_attention_and_pairs_every_transfer():
    logs = run_ranks(_check_rings, 4, timeout=120)
    for key in logs[0]:
        cp = key[0]
        for ring in ([[0, 1], [2, 3]] if cp == 2 else [[0, 1, 2, 3]]):
            for position, rank in enumerate(ring):
                following, preceding = ring[(position + 1) % cp], ring[(position - 1) % cp]
                calls = logs[rank][key]
                assert calls, key
                # Every call is one send to the next member and one receive from the previous one, and the
                # next member's receives match this rank's sends call by call: NCCL pairs them by order.
                assert all([(op[0], op[1]) for op in call] == [("send", following), ("recv", preceding)]
                           for call in calls), (rank, key, calls)
                assert [call[0][2] for call in calls] == [call[1][2] for call in logs[following][key]], (rank, key)


def test_chunks_balance_the_causal_work():
    for cp in (1, 2, 4):
        starts = [chunk_starts(64, cp, r) for r in range(cp)]
        covered = sorted(s for pair in starts for s in pair)
        assert covered == list(range(0, 64, 64 // (2 * cp)))
        # Keys attended per rank (causal): equal for every rank.
        work = {sum(s + 1 for start in pair for s in range(start, start + 64 // (2 * cp))) for pair in starts}
        assert len(work) == 1


@pytest.mark.parametrize("docs", [None, "documents"])
def test_one_rank_ring_equals_dense(docs):
    offsets = _documents(3) if docs else None
    batch = BATCH if offsets is None else offsets.shape[0]
    q, k, v, grad = (torch.randn(batch, h, SEQ, DIM, dtype=torch.float64) for h in (HEADS, GROUPS, GROUPS, HEADS))
    want, want_grads = _reference(q, k, v, offsets, grad)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, Ring(None, 0, 1), offsets)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for got, expected in zip(torch.autograd.grad(out, leaves, grad), want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
