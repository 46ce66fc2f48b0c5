"""The planner's ranked table, as plain text a person can paste into a note.

sched is each layout's pipeline schedule (``parallel.pipeline_schedule``), cp-comm how its context parallelism
communicates (``parallel.cp_comm``). MoE models get two more columns, ep and the exposed all-to-all time; a dense
model's table has neither."""
from __future__ import annotations

from .memory import GIB
from .search import Estimate


def _header(unit: str, moe: bool) -> str:
    return (f"   #  tp  cp  pp   dp {'  ep ' if moe else ''}  v sched       mbs recompute zero    tp-comm   "
            f"cp-comm    | {unit}/GPU = params  "
            f"grads  optim    act  other |  step s  bubble  tp-exp  cp-exp {' ep-a2a ' if moe else ''}  pp+dp |   "
            "tokens/s   MFU")


def format_row(index: int, est: Estimate, scale: float = GIB, moe: bool = False) -> str:
    lay, mem, time = est.layout, est.memory, est.time
    other, act = mem.transient + mem.overhead, mem.activations + mem.held  # held: a split backward's (I to W)
    fit = "" if est.fits else "  OOM"
    ep = f"{lay.ep:>4} " if moe else ""
    a2a = f"{time.ep_exposed:>7.3g} " if moe else ""
    pp_dp = time.pp_comm + time.dp_exposed + time.host_exposed
    return (f"{index:>4} {lay.tp:>3} {lay.cp:>3} {lay.pp:>3} {lay.dp:>4} {ep}{lay.virtual_pp:>3} "
            f"{lay.schedule_mode:<11} {lay.micro_batch:>3} "
            f"{lay.recompute:<9} {lay.zero_mode:<7} {lay.tp_mode:<9} {lay.cp_mode:<10} | {mem.total / scale:>7.1f} = "
            f"{mem.params / scale:>6.1f} {mem.grads / scale:>6.1f} {mem.optimizer / scale:>6.1f} "
            f"{act / scale:>6.1f} {other / scale:>6.1f} | {time.total:>7.4g} {time.bubble:>7.3g} "
            f"{time.tp_exposed:>7.3g} {time.cp_exposed:>7.3g} {a2a}{pp_dp:>7.3g} | "
            f"{est.tokens_per_s:>10,.0f} {est.mfu:>5.1%}{fit}")


def format_table(estimates: list[Estimate], shown: list[Estimate], moe: bool = False) -> str:
    """``shown`` (the first ranked ``estimates``) one line each, under a header (MiB for tiny models); ``moe``
    adds the expert-parallel columns."""
    fitting = sum(e.fits for e in estimates)
    scale, unit = (GIB, "GiB") if any(e.memory.total >= GIB for e in shown) else (2**20, "MiB")
    lines = [f"{len(estimates)} valid layouts, {fitting} fit in memory"
             + ("" if fitting else " (none fit: the nearest misses follow)") + ".", _header(unit, moe)]
    lines += [format_row(i + 1, est, scale, moe) for i, est in enumerate(shown)]
    lines.append(f"{unit}/GPU: the pipeline rank with the most memory; other = transient peaks + fixed overhead. "
                 "sched: the pipeline schedule (parallel.pipeline_schedule; - without a pipeline), bubble its closed "
                 "form. "
                 "tp-comm: domino = TP all-reduces overlapped by Domino, sp = sequence parallel "
                 "(sp+domino: both), - = no TP. cp-comm: ring, a2a (all-to-alls over the heads) or a2aN+ring "
                 "(all-to-alls in groups of N CP ranks, a ring across them). cp-exp: the ring's K/V transfers not "
                 "hidden behind attention, and the all-to-alls. zero: the stage, p0 without prefetch, +cpu with "
                 "the optimizer offloaded; pp+dp includes the host step an offload leaves exposed."
                 + (" ep: expert-parallel size; ep-a2a: its token all-to-alls (exposed)." if moe else "")
                 + " Times in seconds per step.")
    return "\n".join(lines)
