"""Pipeline schedules as data: a registry of ``record.Schedule``s by name, one file per schedule in this package.

Each schedule builds one program per pipeline rank (``program``'s vocabulary). Keeping the schedule a plain value
(instead of code interleaved with p2p calls) lets the simulator prove it deadlock-free under NCCL's rules without
starting a process, and lets the executor stay a dumb loop over the list. A rank's program alternates compute
instructions with ``TransferGroup``s: the group between two computes holds the send of what the first produced and
the receive of what the second consumes, issued together as one ``batch_isend_irecv`` (Megatron's
send-forward/receive-backward pairing). NCCL ignores tags, matches each pair's transfers in issue order and
completes a large send only once its receive runs; grouping the send with the receive is what keeps neighbours
from each waiting on the other's send. Every rank visits forwards (and, separately, backwards) in the same
rank-independent ``(chunk, microbatch)`` order, which keeps each pair's sends and receives in one order.

Every module of this package but ``record`` is a schedule and is imported here, so a new file is a new schedule
for the config, the executor, the planner, the rehearsal, the dry run and the pictures alike.
"""
from __future__ import annotations

import importlib
import pkgutil

from ...config.checks import Checks
from ..program import virtual_stage
from .record import Schedule

SCHEDULES: dict[str, Schedule] = {}


def register(schedule: Schedule) -> Schedule:
    """Add ``schedule`` under its name (once); returns it."""
    if schedule.name in SCHEDULES:
        raise ValueError(f"a pipeline schedule named {schedule.name!r} is registered already")
    SCHEDULES[schedule.name] = schedule
    return schedule


def unregister(name: str) -> None:
    SCHEDULES.pop(name)


def names() -> tuple[str, ...]:
    """The names ``parallel.pipeline_schedule`` takes, in their records' order."""
    return tuple(s.name for s in sorted(SCHEDULES.values(), key=lambda s: s.order) if s.name != "none")


def get(kind: str) -> Schedule:
    if kind not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {kind!r}; fix: one of {', '.join(names())}")
    return SCHEDULES[kind]


def implied_chunks(requested: str | None) -> int | None:
    """The chunk count a requested schedule implies when ``parallel.virtual_pp`` is unset (the V's 2), else None."""
    schedule = SCHEDULES.get(requested)
    return schedule.chunks if schedule is not None and schedule.chunks not in (None, 1) else None


def schedule_kind(pp: int, virtual_pp: int, requested: str | None = None) -> str:
    """The schedule a layout runs: ``requested`` (parallel.pipeline_schedule) where set, else the default for its
    chunk count (1f1b with one, interleaved with several); "none" without a pipeline, whatever was requested."""
    if pp == 1:
        return "none"
    if requested is not None:
        return requested
    return next(name for name in names() if SCHEDULES[name].planner_default and SCHEDULES[name].takes(virtual_pp))


def v_shape(kind: str | None) -> bool:
    """Whether schedule ``kind`` lays its 2 chunks per rank out in a V (``program.virtual_stage``)."""
    return kind in SCHEDULES and SCHEDULES[kind].v_shape


def chunk_stage(parallel, pp_rank: int, chunk: int) -> int:
    """Virtual stage of ``chunk`` on ``pp_rank`` under these settings (``cfg.parallel``): the V for the V schedules,
    else the interleaved layout. Every placement of layers on ranks goes through here."""
    kind = schedule_kind(parallel.pp, parallel.virtual_pp, parallel.pipeline_schedule)
    return virtual_stage(pp_rank, chunk, parallel.pp, v_shape(kind))


def least_microbatches(kind: str, pp: int) -> int:
    """The fewest micro-batches per step that ``kind`` runs with (a V's fill)."""
    return get(kind).least_microbatches(pp)


def _check_chunks(c: Checks, s: Schedule, pp: int, virtual_pp: int) -> None:
    key = "parallel.pipeline_schedule"
    if s.v_shape and virtual_pp != 2:
        c.fail("parallel.virtual_pp", virtual_pp, f"the {s.name} schedule holds exactly 2 model chunks per pipeline "
               f"rank (a V: rank r holds stages r and 2 * pp - 1 - r)", "leave parallel.virtual_pp unset (2 is "
               "implied) or set it to 2, or choose another parallel.pipeline_schedule")
    elif s.chunks is None and virtual_pp == 1:
        c.fail(key, s.name, f"needs parallel.virtual_pp > 1, but parallel.virtual_pp = 1", "set parallel.virtual_pp "
               f">= 2, or a schedule of one chunk per rank ({', '.join(n for n in names() if get(n).chunks == 1)})")
    elif s.chunks == 1 and virtual_pp > 1:
        c.fail(key, s.name, f"holds one model chunk per pipeline rank, but parallel.virtual_pp = {virtual_pp}",
               f"set parallel.virtual_pp=1, or a schedule that takes {virtual_pp} chunks per rank "
               f"({', '.join(n for n in names() if get(n).takes(virtual_pp)) or 'none'})")


def _check_microbatches(c: Checks, s: Schedule, pp: int, virtual_pp: int, num_microbatches: int) -> None:
    least = s.least_microbatches(pp)
    if s.least_per_pp and num_microbatches < least:
        text = "parallel.pp" if s.least_per_pp == 1 else f"{s.least_per_pp} * parallel.pp"
        c.fail("parallel.pipeline_schedule", s.name, f"needs at least {text} = {least} micro-batches per step "
               f"(train.global_batch_size / (train.micro_batch_size * dp)), got {num_microbatches}",
               f"raise train.global_batch_size to at least {least} * train.micro_batch_size * dp, or use a "
               f"schedule without that need ({', '.join(n for n in names() if get(n).least_per_pp == 0)})")
    elif s.multiple_of_pp and num_microbatches % pp:
        c.fail("parallel.virtual_pp", virtual_pp, f"the {s.name} schedule needs the micro-batches per step "
               f"(train.global_batch_size / (train.micro_batch_size * dp) = {num_microbatches}) to be a multiple "
               f"of parallel.pp = {pp}", f"make train.global_batch_size a multiple of train.micro_batch_size * dp * "
               f"{pp}, or set parallel.virtual_pp=1")


def check_schedule(c: Checks, pp: int, virtual_pp: int, num_microbatches: int | None = None,
                   requested: str | None = None) -> None:
    """The rules of ``parallel.pipeline_schedule`` (``requested``; None: chosen by ``schedule_kind``) and of
    interleaving; ``num_microbatches`` (per step and DP rank) when known. ``validate_config``, the planner's
    search and ``build_schedule`` all run these."""
    if requested is not None and requested not in SCHEDULES:
        c.one_of("parallel.pipeline_schedule", requested, ("none", *names()))
        return
    if requested == "none" and (pp != 1 or virtual_pp != 1):
        c.fail("parallel.pp", pp, f"schedule 'none' runs without a pipeline (parallel.virtual_pp = {virtual_pp})",
               "set parallel.pp: 1 and parallel.virtual_pp: 1, or use the '1f1b' schedule")
        return
    if virtual_pp > 1 and pp == 1:
        c.fail("parallel.virtual_pp", virtual_pp, "needs parallel.pp > 1 (interleaving splits pipeline stages), "
               "but parallel.pp = 1", "set parallel.virtual_pp=1 or parallel.pp >= 2")
        return
    if pp == 1:
        return
    schedule = get(requested if requested is not None else schedule_kind(pp, virtual_pp))
    before = len(c.problems)
    _check_chunks(c, schedule, pp, virtual_pp)
    if num_microbatches is not None and len(c.problems) == before:
        _check_microbatches(c, schedule, pp, virtual_pp, num_microbatches)


def check_f_and_b(c: Checks, parallel, f_and_b_turns: bool) -> None:
    """``parallel.overlap_f_and_b`` works only where the schedule has F&B units and their halves have waits to take
    turns at (``f_and_b_turns``: ``config.rules.f_and_b_turns``)."""
    kind = schedule_kind(parallel.pp, parallel.virtual_pp, parallel.pipeline_schedule)
    has_units = kind in SCHEDULES and SCHEDULES[kind].f_and_b_units
    if parallel.overlap_f_and_b and not (has_units and f_and_b_turns):
        units = ", ".join(s.name for s in SCHEDULES.values() if s.f_and_b_units)
        c.warnings.append(f"parallel.overlap_f_and_b=true has no effect: only {units} has F&B units, and their "
                          f"halves take turns at Domino's waits (parallel.domino=true, parallel.tp > 1) and at the "
                          f"experts' exchanges (parallel.ep > 1)")


def schedule_for(parallel, num_microbatches: int, forward_only: bool = False) -> tuple[str, list[list]]:
    """What a run with these settings (``cfg.parallel``) executes: the schedule's kind and every rank's
    program. Training, evaluation and ``--print-schedule`` all come through here."""
    kind = schedule_kind(parallel.pp, parallel.virtual_pp, parallel.pipeline_schedule)
    return kind, build_schedule(kind, parallel.pp, num_microbatches, parallel.virtual_pp, forward_only)


def build_schedule(kind: str, pp: int, num_microbatches: int, virtual_pp: int = 1,
                   forward_only: bool = False) -> list[list]:
    """Program (compute instructions and transfer groups) of every pipeline rank (index = rank), by the schedule
    ``kind``; ``forward_only`` (evaluation): the schedule's forwards in the same order."""
    c = Checks()
    check_schedule(c, pp, virtual_pp, num_microbatches, kind)
    c.raise_problems()
    if num_microbatches < 1:
        raise ValueError(f"the number of micro-batches (train.global_batch_size / (train.micro_batch_size * dp)) "
                         f"is {num_microbatches} but must be >= 1; fix: raise train.global_batch_size")
    return get(kind).build(pp, num_microbatches, virtual_pp, forward_only)


for _module in pkgutil.iter_modules(__path__):
    if _module.name != "record":
        importlib.import_module(f"{__name__}.{_module.name}")
