"""Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): v model chunks per rank, 1F1B over m * v chunk-micro-batches.

Chunk c of rank r is virtual stage c * pp + r. Groups of pp micro-batches sweep the chunks in turn, which needs m to
be a multiple of pp. Bubble (pp - 1) / (v m + pp - 1): 3 (pp - 1) idle units of 3 v a micro-batch, (pp - 1) / v
micro-batch times. In flight on rank r: Megatron's warm-up count + 1 chunk-micro-batches.
"""
from __future__ import annotations

from ..program import Instruction
from . import register
from .record import Schedule, one_forward_one_backward, programs


def _chunk(k: int, pp: int, virtual_pp: int, forward: bool) -> int:
    """Chunk of the k-th virtual micro-batch: groups of pp micro-batches sweep the chunks in turn."""
    chunk = (k % (pp * virtual_pp)) // pp
    return chunk if forward else virtual_pp - 1 - chunk


def _microbatch(k: int, pp: int, virtual_pp: int) -> int:
    return (k // (pp * virtual_pp)) * pp + k % pp


def interleaved_warmup(pp: int, rank: int, num_microbatches: int, virtual_pp: int) -> int:
    """Chunk-forwards a rank runs before its first backward (Megatron's rule): enough for micro-batch 0 to reach the
    last virtual stage and its gradient to come back to this rank; with exactly pp micro-batches every forward first.
    """
    total = num_microbatches * virtual_pp
    if num_microbatches == pp:
        return total
    return min((pp - rank - 1) * 2 + (virtual_pp - 1) * pp, total)


def _order(pp: int, rank: int, m: int, v: int) -> list[list[Instruction]]:
    total = m * v
    fwd = [Instruction("forward", _microbatch(k, pp, v), _chunk(k, pp, v, True)) for k in range(total)]
    bwd = [Instruction("backward", _microbatch(k, pp, v), _chunk(k, pp, v, False)) for k in range(total)]
    return one_forward_one_backward(fwd, bwd, interleaved_warmup(pp, rank, m, v))


def _build(pp: int, m: int, virtual_pp: int, forward_only: bool) -> list[list]:
    return programs(lambda rank: _order(pp, rank, m, virtual_pp), pp, virtual_pp, forward_only)


INTERLEAVED = register(Schedule(
    name="interleaved", label="Interleaved 1F1B", summary="v chunks per rank: a bubble v times smaller, more transfers",
    build=_build, bubble=lambda pp, m, v: (pp - 1) / v,
    in_flight=lambda pp, m, v: [min(interleaved_warmup(pp, rank, m, v) + 1, m * v) for rank in range(pp)],
    chunks=None, multiple_of_pp=True, planner_default=True, picture_chunks=2, order=2))
