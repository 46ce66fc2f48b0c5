"""Ring attention: causal attention over a sequence split across the context-parallel (CP) ranks.

The sequence is cut into 2·cp equal chunks and CP rank i holds chunks i and 2·cp−1−i, so every
rank has the same causal work (an early chunk sees few keys, its partner many). In each layer the
ranks' K/V blocks travel once around the ring (cp−1 steps, the next block in flight while the
current one is computed). A rank attends its queries to each block, chunk pair by chunk pair: a
key chunk after the query chunk is skipped, the same chunk is causal, an earlier one is attended
in full. The partial results merge through their log-sum-exps (online softmax):
``lse = logaddexp(lse_a, lse_b)``, ``out = out_a·e^(lse_a−lse) + out_b·e^(lse_b−lse)``.

With packed documents (``doc_offsets``, global positions, per sample) each chunk pair is cut
further into the pieces of the documents it holds: only a document's own keys are attended, and
no [L, L] mask is ever built.

The backward runs the ring again. The flash kernels' backward takes the merged output and
log-sum-exp, so each block's gradients come out exact; the K/V gradients travel with their blocks
(each hop overlapping the next step's compute) and reach their owner after a full turn.

Every transfer is one batched pair, send to the next rank and receive from the previous one
(``batch_isend_irecv``), issued by all ring members in the same order: NCCL's p2p rules, with
no reliance on buffering.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .attention_kernels import accumulation_dtype, attention_backward, attention_forward
from .document_attention import document_spans
from .logit_max import fold


@dataclass(frozen=True)
class Ring:
    """This rank's place in its CP ring: the group, its rank in it (= its cp coordinate) and the size."""

    group: object
    rank: int
    size: int


def chunk_starts(seq_length: int, cp_size: int, cp_rank: int, a2a: int = 1) -> tuple[int, int]:
    """Global start of the two pieces CP rank ``cp_rank`` holds (each seq_length / (2·cp) long): chunks i and
    2·cp−1−i; under a2a+ring (``a2a`` ranks per all-to-all group, ring r = cp / a2a) member u of group j holds
    piece u of the ring's chunks j and 2·r−1−j, so that the group together holds ring member j's two chunks."""
    ring, (j, u) = cp_size // a2a, divmod(cp_rank, a2a)
    chunk = seq_length // (2 * ring)
    piece = chunk // a2a
    return j * chunk + u * piece, (2 * ring - 1 - j) * chunk + u * piece


def local_positions(seq_length: int, cp_size: int, cp_rank: int, device=None, a2a: int = 1) -> torch.Tensor:
    """Global positions of this rank's tokens, in the order it holds them (int64 [seq_length / cp]), made on
    ``device`` (built there, not copied from the host)."""
    piece = seq_length // (2 * cp_size)
    return torch.cat([torch.arange(start, start + piece, device=device)
                      for start in chunk_starts(seq_length, cp_size, cp_rank, a2a)])


def split_for_context_parallel(batch: dict, cp_size: int, cp_rank: int, a2a: int = 1) -> dict:
    """This rank's part of a micro-batch: its two pieces of every per-token tensor, with their global positions
    (``a2a``: a2a+ring's all-to-all group size, ``chunk_starts``).

    Document offsets stay whole: they are global positions, read by ring attention.
    """
    seq_length = batch["tokens"].shape[1]
    index = local_positions(seq_length, cp_size, cp_rank, a2a=a2a)
    part = {key: value if key == "doc_offsets" else value.index_select(1, index) for key, value in batch.items()}
    if "position_ids" not in part:  # whole rows, not a stride-0 view: the copy to the device needs dense memory
        part["position_ids"] = index.repeat(batch["tokens"].shape[0], 1)
    return part


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                   doc_offsets: torch.Tensor | None = None, logit_max: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole ring's keys: q [b, heads, s/cp, d], k and v
    [b, groups, s/cp, d] (grouped-query heads as they are); ``doc_offsets`` [b, n + 1] host int32 or None;
    ``logit_max``: each head's running largest logit, folded over every block attended (``logit_max``)."""
    return _RingAttention.apply(q, k, v, ring, doc_offsets, logit_max)


@dataclass(frozen=True)
class _Piece:
    """One kernel call: rows of the batch, query positions and key positions (local), causal or full."""

    rows: slice
    queries: slice
    keys: slice
    causal: bool

    @property
    def at_queries(self) -> tuple:
        """Index of the piece's queries in a [b, heads, s/cp, d] tensor."""
        return self.rows, slice(None), self.queries

    @property
    def at_keys(self) -> tuple:
        return self.rows, slice(None), self.keys


def _schedule(ring: Ring, chunk: int, doc_offsets) -> list[list[_Piece]]:
    """Per ring step, the kernel calls between this rank's queries and the K/V block it holds then (the backward
    replays the forward's schedule)."""
    spans = None if doc_offsets is None else [document_spans(row) for row in doc_offsets.tolist()]
    return [_pieces(ring, (ring.rank - step) % ring.size, chunk, spans) for step in range(ring.size)]


def _pieces(ring: Ring, source: int, chunk: int, spans) -> list[_Piece]:
    """The kernel calls between this rank's queries and the K/V block of CP rank ``source``; ``spans``: each
    sample's documents as [(start, end)], or None."""
    pieces = []
    query_chunks = zip((0, chunk), (ring.rank, 2 * ring.size - 1 - ring.rank))
    for q_local, q_index in query_chunks:
        for k_local, k_index in zip((0, chunk), (source, 2 * ring.size - 1 - source)):
            if k_index > q_index:
                continue
            causal = k_index == q_index
            if spans is None:
                pieces.append(_Piece(slice(None), slice(q_local, q_local + chunk), slice(k_local, k_local + chunk),
                                     causal))
                continue
            q_start, k_start = q_index * chunk, k_index * chunk
            for row, documents in enumerate(spans):
                for start, end in documents:
                    q_lo, q_hi = max(start, q_start), min(end, q_start + chunk)
                    k_lo, k_hi = max(start, k_start), min(end, k_start + chunk)
                    if q_lo < q_hi and k_lo < k_hi:
                        pieces.append(_Piece(slice(row, row + 1),
                                             slice(q_local + q_lo - q_start, q_local + q_hi - q_start),
                                             slice(k_local + k_lo - k_start, k_local + k_hi - k_start), causal))
    return pieces


def _shift(tensor: torch.Tensor, ring: Ring):
    """Send ``tensor`` to the next ring member and receive the previous one's: (buffer, pending works)."""
    received = torch.empty_like(tensor)
    peer = lambda offset: dist.get_global_rank(ring.group, (ring.rank + offset) % ring.size)  # noqa: E731
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer(1), ring.group),
                                    dist.P2POp(dist.irecv, received, peer(-1), ring.group)])
    return received, works


def _wait(works) -> None:
    """On NCCL the wait goes on the stream; the host runs on."""
    for work in works:
        work.wait()


def _expand(kv: torch.Tensor, queries_per_group: int) -> torch.Tensor:
    return kv if queries_per_group == 1 else kv.repeat_interleave(queries_per_group, dim=1)


def _fold(grad: torch.Tensor, queries_per_group: int) -> torch.Tensor:
    """Gradients of expanded K/V heads summed back onto their group's head."""
    if queries_per_group == 1:
        return grad
    b, heads, s, d = grad.shape
    return grad.view(b, heads // queries_per_group, queries_per_group, s, d).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, doc_offsets, logit_max):
        chunk, per_group = q.shape[2] // 2, q.shape[1] // k.shape[1]
        acc = accumulation_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        block, schedule = torch.stack([k, v]), _schedule(ring, chunk, doc_offsets)
        for step, pieces in enumerate(schedule):
            incoming = _shift(block, ring) if step < ring.size - 1 else None
            keys, values = _expand(block[0], per_group), _expand(block[1], per_group)
            for piece in pieces:
                at_q, at_k = piece.at_queries, piece.at_keys
                part, part_lse = attention_forward(q[at_q], keys[at_k], values[at_k], piece.causal)
                if logit_max is not None:
                    fold(logit_max, q[at_q], keys[at_k], piece.causal)
                merged = torch.logaddexp(lse[at_q], part_lse)
                out[at_q] = (out[at_q] * torch.exp(lse[at_q] - merged).unsqueeze(-1)
                             + part.to(acc) * torch.exp(part_lse - merged).unsqueeze(-1))
                lse[at_q] = merged
            if incoming is not None:
                _wait(incoming[1])
                block = incoming[0]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.schedule = ring, schedule
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, per_group = ctx.ring, q.shape[1] // k.shape[1]
        grad_out = grad_out.contiguous()
        acc = accumulation_dtype(q.dtype)
        grad_q = torch.zeros(q.shape, dtype=acc, device=q.device)
        block = torch.stack([k, v])
        travelling = None  # the held block's gradient from the ranks before: (buffer, pending works)
        for step, pieces in enumerate(ctx.schedule):
            incoming = _shift(block, ring) if step < ring.size - 1 else None
            keys, values = _expand(block[0], per_group), _expand(block[1], per_group)
            grad_block = torch.zeros(block.shape, dtype=acc, device=q.device)
            for piece in pieces:
                at_q, at_k = piece.at_queries, piece.at_keys
                dq, dk, dv = attention_backward(grad_out[at_q], q[at_q], keys[at_k], values[at_k], out[at_q],
                                                lse[at_q], piece.causal)
                grad_q[at_q] += dq.to(acc)
                grad_block[(0, *at_k)] += _fold(dk.to(acc), per_group)
                grad_block[(1, *at_k)] += _fold(dv.to(acc), per_group)
            if travelling is not None:  # it travelled while this step computed
                _wait(travelling[1])
                grad_block += travelling[0]
            # On with the block's gradient to the rank that holds the block next; the last hop takes it home.
            travelling = _shift(grad_block, ring) if ring.size > 1 else (grad_block, [])
            if incoming is not None:
                _wait(incoming[1])
                block = incoming[0]
        _wait(travelling[1])
        grad_block = travelling[0]
        return grad_q.to(q.dtype), grad_block[0].to(k.dtype), grad_block[1].to(v.dtype), None, None, None
