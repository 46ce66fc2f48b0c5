"""Pipeline schedules as data: one program per pipeline rank (``program``'s vocabulary), built by the
builder the schedule's kind names in ``BUILDERS``.

Keeping the schedule a plain value (instead of code interleaved with p2p calls)
lets the simulator prove it deadlock-free under NCCL's rules without starting a
process, and lets the executor stay a dumb loop over the list.

A rank's program alternates compute instructions with ``TransferGroup``s. The group
between two computes holds the send of what the first produced and the receive of what
the second consumes, issued together as one ``batch_isend_irecv`` (Megatron's
send-forward/receive-backward pairing). NCCL ignores tags, matches each pair's transfers
in issue order and completes a large send only once its receive runs; grouping the
send with the receive is what keeps neighbours from each waiting on the other's send.
Every rank visits forwards (and, separately, backwards) in the same rank-independent
``(chunk, microbatch)`` order, which keeps each pair's sends and receives in one order.
"""
from __future__ import annotations

from ..config.checks import Checks
from ..config.schema import PIPELINE_SCHEDULES, V_SCHEDULES
from .dualpipe_v import dualpipe_v_programs
from .program import Instruction, add_transfers, virtual_stage
from .zero_bubble import zb_h1_programs
from .zero_bubble_v import zb_v_programs

KINDS = ("none",) + PIPELINE_SCHEDULES  # "none": pp 1, gradient accumulation


def _one_forward_one_backward(forwards: list, backwards: list, warmup: int) -> list[list[Instruction]]:
    """Warm-up forwards, then iterations of one forward and one backward, then drain the backwards."""
    steady = len(forwards) - warmup
    iterations = [[f] for f in forwards[:warmup]]
    iterations += [[forwards[warmup + i], backwards[i]] for i in range(steady)]
    return iterations + [[b] for b in backwards[steady:]]


def _interleaved_chunk(k: int, pp: int, virtual_pp: int, forward: bool) -> int:
    """Chunk of the k-th virtual micro-batch: groups of pp micro-batches sweep the chunks in turn."""
    chunk = (k % (pp * virtual_pp)) // pp
    return chunk if forward else virtual_pp - 1 - chunk


def _interleaved_microbatch(k: int, pp: int, virtual_pp: int) -> int:
    return (k // (pp * virtual_pp)) * pp + k % pp


def _interleaved_order(pp: int, rank: int, m: int, v: int) -> list[list[Instruction]]:
    total = m * v
    fwd = [Instruction("forward", _interleaved_microbatch(k, pp, v), _interleaved_chunk(k, pp, v, True))
           for k in range(total)]
    bwd = [Instruction("backward", _interleaved_microbatch(k, pp, v), _interleaved_chunk(k, pp, v, False))
           for k in range(total)]
    return _one_forward_one_backward(fwd, bwd, interleaved_warmup(pp, rank, m, v))


def interleaved_warmup(pp: int, rank: int, num_microbatches: int, virtual_pp: int) -> int:
    """Chunk-forwards a rank runs before its first backward in the interleaved schedule (Megatron's rule).

    Enough for micro-batch 0 to reach the last virtual stage and its gradient to come back to this rank;
    with exactly pp micro-batches every forward runs first.
    """
    total = num_microbatches * virtual_pp
    if num_microbatches == pp:
        return total
    return min((pp - rank - 1) * 2 + (virtual_pp - 1) * pp, total)


def schedule_kind(pp: int, virtual_pp: int, requested: str | None = None) -> str:
    """The schedule a layout runs: ``requested`` (parallel.pipeline_schedule) where set, else "interleaved" with
    several chunks per rank and "1f1b" with one; "none" without a pipeline, whatever was requested."""
    if pp == 1:
        return "none"
    if requested is not None:
        return requested
    return "interleaved" if virtual_pp > 1 else "1f1b"


def v_shape(kind: str | None) -> bool:
    """Whether schedule ``kind`` lays its 2 chunks per rank out in a V (``program.virtual_stage``)."""
    return kind in V_SCHEDULES


def chunk_stage(parallel, pp_rank: int, chunk: int) -> int:
    """Virtual stage of ``chunk`` on ``pp_rank`` under these settings (``cfg.parallel``): the V for zb-v and
    dualpipev, else the interleaved layout. Every placement of layers on ranks goes through here."""
    kind = schedule_kind(parallel.pp, parallel.virtual_pp, parallel.pipeline_schedule)
    return virtual_stage(pp_rank, chunk, parallel.pp, v_shape(kind))


def least_microbatches(kind: str, pp: int) -> int:
    """The fewest micro-batches per step that ``kind`` runs with: the V's fill (zb-v pp, dualpipev 2 pp), else 1."""
    return {"zb-v": pp, "dualpipev": 2 * pp}.get(kind, 1)


def _check_v(c: Checks, kind: str, pp: int, virtual_pp: int, num_microbatches: int | None) -> None:
    """zb-v and dualpipev: exactly 2 chunks per rank, and enough micro-batches to fill the V."""
    least = least_microbatches(kind, pp)
    if virtual_pp != 2:
        c.fail("parallel.virtual_pp", virtual_pp, f"the {kind} schedule holds exactly 2 model chunks per pipeline "
               f"rank (a V: rank r holds stages r and 2 * pp - 1 - r)", "leave parallel.virtual_pp unset (2 is "
               "implied) or set it to 2, or choose another parallel.pipeline_schedule")
    elif num_microbatches is not None and num_microbatches < least:
        c.fail("parallel.pipeline_schedule", kind, f"needs at least {'' if kind == 'zb-v' else '2 * '}parallel.pp "
               f"= {least} micro-batches per step (train.global_batch_size / (train.micro_batch_size * dp)), got "
               f"{num_microbatches}", f"raise train.global_batch_size to at least {least} * train.micro_batch_size "
               f"* dp, or use parallel.pipeline_schedule=zb-h1")


def check_schedule(c: Checks, pp: int, virtual_pp: int, num_microbatches: int | None = None,
                   requested: str | None = None) -> None:
    """The rules of ``parallel.pipeline_schedule`` (``requested``; None: chosen by ``schedule_kind``) and of
    interleaving; ``num_microbatches`` (per step and DP rank) when known. ``validate_config``, the planner's
    search and ``build_schedule`` all run these."""
    key = "parallel.pipeline_schedule"
    if requested is not None:
        c.one_of(key, requested, KINDS)
    if requested == "none" and (pp != 1 or virtual_pp != 1):
        c.fail("parallel.pp", pp, f"schedule 'none' runs without a pipeline (parallel.virtual_pp = {virtual_pp})",
               "set parallel.pp: 1 and parallel.virtual_pp: 1, or use the '1f1b' schedule")
    elif virtual_pp > 1 and pp == 1:
        c.fail("parallel.virtual_pp", virtual_pp, "needs parallel.pp > 1 (interleaving splits pipeline stages), "
               "but parallel.pp = 1", "set parallel.virtual_pp=1 or parallel.pp >= 2")
    elif v_shape(requested):
        _check_v(c, requested, pp, virtual_pp, num_microbatches)
    elif requested == "interleaved" and virtual_pp == 1:
        c.fail(key, requested, "needs parallel.virtual_pp > 1, but parallel.virtual_pp = 1",
               "set parallel.virtual_pp >= 2, or parallel.pipeline_schedule=1f1b or zb-h1")
    elif requested in ("1f1b", "zb-h1") and virtual_pp > 1:
        c.fail(key, requested, f"holds one model chunk per pipeline rank, but parallel.virtual_pp = {virtual_pp}",
               "set parallel.virtual_pp=1, or parallel.pipeline_schedule=interleaved (or zb-v / dualpipev with 2)")
    elif num_microbatches is not None and virtual_pp > 1 and num_microbatches % pp:
        c.fail("parallel.virtual_pp", virtual_pp, f"the interleaved schedule needs the micro-batches per step "
               f"(train.global_batch_size / (train.micro_batch_size * dp) = {num_microbatches}) to be a multiple "
               f"of parallel.pp = {pp}", f"make train.global_batch_size a multiple of train.micro_batch_size * dp * "
               f"{pp}, or set parallel.virtual_pp=1")


def schedule_for(parallel, num_microbatches: int, forward_only: bool = False) -> tuple[str, list[list]]:
    """What a run with these settings (``cfg.parallel``) executes: the schedule's kind and every rank's
    program. Training, evaluation and ``--print-schedule`` all come through here."""
    kind = schedule_kind(parallel.pp, parallel.virtual_pp, parallel.pipeline_schedule)
    return kind, build_schedule(kind, parallel.pp, num_microbatches, parallel.virtual_pp, forward_only)


def _one_f_one_b(pp: int, m: int, virtual_pp: int, forward_only: bool) -> list[list]:
    """"none" (pp 1: F0 B0 F1 B1 ..., gradient accumulation) and "1f1b": a warm-up of min(pp - rank - 1, m)
    forwards, then one forward and one backward, then the cool-down; each output sent right after it is made."""
    def order(rank: int) -> list[list[Instruction]]:
        fwd = [Instruction("forward", i) for i in range(m)]
        bwd = [Instruction("backward", i) for i in range(m)]
        return [[c] for it in _one_forward_one_backward(fwd, bwd, min(pp - rank - 1, m)) for c in it]
    return _programs(order, pp, virtual_pp, forward_only)


def _interleaved(pp: int, m: int, virtual_pp: int, forward_only: bool) -> list[list]:
    """The same shape over m * virtual_pp chunk-micro-batches (Megatron's interleaved 1F1B)."""
    return _programs(lambda rank: _interleaved_order(pp, rank, m, virtual_pp), pp, virtual_pp, forward_only)


def _programs(order, pp: int, virtual_pp: int, forward_only: bool) -> list[list]:
    """Each rank's computes (``order(rank)``, in iterations), the backwards dropped when ``forward_only``, with
    their transfer groups."""
    programs = []
    for rank in range(pp):
        iterations = order(rank)
        if forward_only:
            iterations = [it for it in ([c for c in it if c.op == "forward"] for it in iterations) if it]
        programs.append(add_transfers(iterations, rank, pp, virtual_pp))
    return programs


def _zero_bubble(pp: int, m: int, virtual_pp: int, forward_only: bool) -> list[list]:
    """ZB-H1 (``zero_bubble``); forward-only it has nothing to split: 1F1B's forwards."""
    return _one_f_one_b(pp, m, virtual_pp, True) if forward_only else zb_h1_programs(pp, m)


def _v_forwards(pp: int, m: int) -> list[list]:
    """The V's forwards alone (evaluation): each rank runs chunk 0's, then chunk 1's, one group per compute."""
    def order(rank: int) -> list[list[Instruction]]:
        return [[Instruction("forward", k, c)] for c in (0, 1) for k in range(m)]
    return [add_transfers(order(rank), rank, pp, 2, v_shape=True) for rank in range(pp)]


def _zero_bubble_v(pp: int, m: int, virtual_pp: int, forward_only: bool) -> list[list]:
    """ZB-V (``zero_bubble_v``)."""
    return _v_forwards(pp, m) if forward_only else zb_v_programs(pp, m)


def _dualpipe_v(pp: int, m: int, virtual_pp: int, forward_only: bool) -> list[list]:
    """DualPipeV (``dualpipe_v``)."""
    return _v_forwards(pp, m) if forward_only else dualpipe_v_programs(pp, m)


# kind -> builder(pp, micro-batches, virtual_pp, forward_only) -> every rank's program
BUILDERS = {"none": _one_f_one_b, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb-h1": _zero_bubble,
            "zb-v": _zero_bubble_v, "dualpipev": _dualpipe_v}


def build_schedule(kind: str, pp: int, num_microbatches: int, virtual_pp: int = 1,
                   forward_only: bool = False) -> list[list]:
    """Program (compute instructions and transfer groups) of every pipeline rank (index = rank), by
    ``BUILDERS[kind]``; ``forward_only`` (evaluation): the schedule's forwards in the same order."""
    c = Checks()
    check_schedule(c, pp, virtual_pp, num_microbatches, kind)
    c.raise_problems()
    if num_microbatches < 1:
        raise ValueError(f"the number of micro-batches (train.global_batch_size / (train.micro_batch_size * dp)) "
                         f"is {num_microbatches} but must be >= 1; fix: raise train.global_batch_size")
    return BUILDERS[kind](pp, num_microbatches, virtual_pp, forward_only)
