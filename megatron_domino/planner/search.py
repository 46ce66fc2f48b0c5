"""Enumerate every valid layout for a cluster, estimate each, and rank them.

A layout (``layout.py``) is (tp, cp, pp, dp, virtual pp, pipeline schedule, micro batch, recompute, ZeRO stage)
plus how TP communicates: Domino's overlap, sequence parallelism, or both; how CP does (``parallel.cp_comm``: the
ring, the all-to-all, and a2a+ring with each all-to-all group size that divides cp, where
``check_context_parallel`` accepts them); and for an MoE model the expert-parallel size ep. The schedule
(``schedule_choices``): at pp > 1, the config's default (1f1b at virtual pp 1, interleaved above); every registered
schedule that takes the layout's chunk count (``pipeline/schedules/``: zb-h1 at 1, zb-v and dualpipev at 2), each
where ``check_schedule`` passes for the layout's micro-batches, only when ``only`` names schedules
(``tools/plan.py --schedule``): the split-backward schedules' held gradients
(``held_gradients.py``) match a rehearsal but no GPU run yet, and ZB-V's rank 0 and DualPipeV are upper bounds
(``memory.py``), so they are offered where asked for, not chosen unasked; a config that sets
``parallel.pipeline_schedule`` fixes it for every layout. Two memory savers are
tried on every layout that does not fit as it is (``with_savers``): the optimizer offloaded to the host (ZeRO >= 1)
and, at ZeRO-3, no prefetch (one gathered layer fewer), alone and together; a layout that fits never gets them
(they only cost time).
Context-parallel sizes are those whose 2*cp chunks split the sequence evenly (ring attention's load balance); ep
sizes divide dp and the number of experts. ``validate_config`` (without file checks) passes one layout of each (tp,
cp, pp, CP comm) and every layout shown or emitted, so the planner never suggests a layout the trainer would
refuse. Ranking: layouts that fit first, fastest first (ties within 3 significant digits go to the one with less
memory); then the ones that do not fit, smallest memory first (the nearest misses say what to change).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import islice, product
from typing import Iterable

from ..config.checks import Checks
from ..config.errors import ConfigError
from ..config.rules import check_batch, check_sequence_split
from ..config.validate_context_parallel import check_context_parallel
from ..config.validate_moe import check_expert_split
from ..config.schema import RECOMPUTE, ZERO_STAGES, Config
from ..pipeline.partition import check_partition
from ..pipeline.schedules import check_schedule, get, names
from ..validation import validate_config
from .hardware import GPU
from .layout import Layout, updated
from .memory import StageMemory, estimate_memory
from .timing import StepTime, TimingAssumptions, estimate_step_time, model_flops_per_step

MICRO_BATCHES = (1, 2, 4, 8)
MAX_TP = 64
UNASKED = (None,)  # when none is asked for: the trainer's own choice, 1f1b or interleaved by virtual pp


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: StageMemory  # the pipeline rank with the most memory
    time: StepTime
    fits: bool
    tokens_per_s: float
    mfu: float


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_modes(tp: int, domino: bool) -> list[tuple[bool, bool]]:
    """(sequence_parallel, domino) choices: Domino as configured, and with tp > 1 sequence parallelism
    with and without it."""
    if tp == 1:
        return [(False, domino)]
    return [(False, domino), (True, False)] + ([(True, True)] if domino else [])


def candidate_layouts(cfg: Config, world_size: int, only: dict[str, Iterable] | None = None) -> list[Layout]:
    """Every layout of ``world_size`` GPUs worth estimating; ``only`` restricts fields of Layout.

    ``validate_config`` costs milliseconds, too much for each of thousands of layouts, so it runs once per
    (tp, cp, pp, CP comm), on the first variant; the rules that tell the variants apart are applied per variant: the
    pipeline's own (``check_partition`` and ``check_schedule``), the batch's (``check_batch``), sequence
    parallelism's (``check_sequence_split``) and the experts' (``check_expert_split``), each the function
    validate_config calls; and ``first_valid`` validates in full whatever is shown or emitted."""
    only = {key: set(values) for key, values in (only or {}).items()}
    unknown = set(only) - set(Layout.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown layout field(s) {sorted(unknown)}; valid: {', '.join(Layout.__dataclass_fields__)}")
    allowed = lambda key, value: key not in only or value in only[key]  # noqa: E731
    layers, seq = cfg.model.num_layers, cfg.model.seq_length
    found = []
    for tp in [t for t in divisors(world_size) if t <= MAX_TP and allowed("tp", t)]:
        for cp in [c for c in divisors(world_size // tp) if (c == 1 or seq % (2 * c) == 0) and allowed("cp", c)]:
            for pp, comm in product([p for p in divisors(world_size // (tp * cp)) if p <= layers and allowed("pp", p)],
                                    _cp_comms(cfg, tp, cp, allowed)):
                pipelines = [(v, kind) for v in range(1, layers // pp + 1) if allowed("virtual_pp", v)
                             for kind in schedule_choices(cfg, pp, v, "schedule" in only)
                             if (kind is None or allowed("schedule", kind)) and _pipeline_fits(cfg, pp, v, kind)]
                variants = [lay for v, kind in pipelines for lay in
                            _variants(cfg, tp, cp, pp, world_size // (tp * cp * pp), v, allowed, comm, kind)]
                if variants and is_valid(cfg, replace(variants[0], recompute=cfg.model.recompute,
                                                      zero_stage=cfg.optimizer.zero_stage)):
                    found += variants
    return found


def _cp_comms(cfg: Config, tp: int, cp: int, allowed) -> list[tuple[str, int | None]]:
    """(cp_comm, cp_a2a_size) choices of tp x cp ranks that the context-parallel rules (``check_context_parallel``)
    pass: the ring, the all-to-all, and a2a+ring with each group size that divides cp; at cp 1, the ring alone (the
    choice is moot, and kept whatever ``allowed`` says)."""
    if cp == 1:
        return [("ring", None)]
    choices = [("ring", None), ("a2a", None)] + [("a2a+ring", n) for n in divisors(cp) if 1 < n < cp]
    par = lambda comm, n: updated(cfg.parallel, tp=tp, cp=cp, cp_comm=comm, cp_a2a_size=n)  # noqa: E731
    return [(comm, n) for comm, n in choices if allowed("cp_comm", comm) and allowed("cp_a2a_size", n)
            and _passes(check_context_parallel, updated(cfg, parallel=par(comm, n)))]


def schedule_choices(cfg: Config, pp: int, v: int, asked: bool = False) -> tuple[str | None, ...]:
    """The pipeline schedules tried at pp x virtual pp ``v`` (see the module docstring): the config's where it sets
    one, none to choose without a pipeline; the split-backward ones when ``asked``; ``_pipeline_fits`` and
    ``_batch_fits`` drop those its rules refuse."""
    if cfg.parallel.pipeline_schedule is not None:
        return (cfg.parallel.pipeline_schedule,)
    if pp == 1:
        return (None,)
    return tuple(name for name in names() if get(name).takes(v)) if asked else UNASKED


def _pipeline_fits(cfg: Config, pp: int, v: int, schedule: str | None, num_microbatches: int | None = None) -> bool:
    """The pipeline's own rules (``check_partition``, ``check_schedule``), as validate_config applies them."""
    p = cfg.parallel
    return (_passes(check_partition, cfg.model.num_layers, pp, v, p.pipeline_partition, p.pipeline_layout)
            and _passes(check_schedule, pp, v, num_microbatches, schedule))


def _variants(cfg: Config, tp: int, cp: int, pp: int, dp: int, v: int, allowed,
              comm: tuple[str, int | None] = ("ring", None), schedule: str | None = None) -> list[Layout]:
    """The micro batch, TP communication, recompute and ZeRO choices of one (tp, cp, pp, dp, virtual pp, CP comm,
    schedule), filtered by the rules that tell them apart (each the function ``validate_config`` calls)."""
    batch, seq = cfg.train.global_batch_size, cfg.model.seq_length
    micro = [b for b in MICRO_BATCHES
             if allowed("micro_batch", b) and _batch_fits(pp, v, schedule, batch, b, dp)]
    modes = [(sp, domino) for sp, domino in _tp_modes(tp, cfg.parallel.domino)
             if (not sp or _passes(check_sequence_split, seq, tp, cp))
             and allowed("sequence_parallel", sp) and allowed("domino", domino)]
    # One replica: the ZeRO stage is moot (``_without_equal_zero_stages`` drops rows that repeat a lower stage).
    stages = [z for z in (ZERO_STAGES if dp * cp > 1 else (cfg.optimizer.zero_stage,)) if allowed("zero_stage", z)]
    eps = [ep for ep in divisors(dp) if allowed("ep", ep) and (
        ep == 1 if not cfg.model.num_experts
        else _passes(check_expert_split, cfg.model.num_experts, ep, tp, cfg.parallel.expert_tp))]
    offload, prefetch = bool(cfg.optimizer.offload), cfg.optimizer.prefetch_depth
    return [Layout(tp, pp, dp, v, b, recompute, zero, sp, domino, cp, ep, offload and zero > 0, prefetch, *comm,
                   schedule)
            for b, (sp, domino), recompute, zero, ep in product(micro, modes, RECOMPUTE, stages, eps)
            if allowed("recompute", recompute)]


def with_savers(layout: Layout) -> list[Layout]:
    """The memory savers of a layout that does not fit (see the module docstring), new ones only."""
    offloads = [layout.offload] + ([True] if layout.zero_stage > 0 and not layout.offload else [])
    depths = [layout.prefetch_depth] + ([0] if layout.zero_stage == 3 and layout.prefetch_depth else [])
    return [replace(layout, offload=o, prefetch_depth=d) for o, d in product(offloads, depths)][1:]


def _passes(rule, *args) -> bool:
    """Whether ``rule`` (one of the rule functions validate_config gathers) finds no problem in ``args``."""
    c = Checks()
    rule(c, *args)
    return not c.problems


def _batch_fits(pp: int, v: int, schedule: str | None, batch: int, micro: int, dp: int) -> bool:
    """Whole micro batches per DP rank, as many as the schedule needs."""
    micro_batches = check_batch(Checks(), batch, micro, dp)
    return micro_batches is not None and _passes(check_schedule, pp, v, micro_batches, schedule)


def first_valid(cfg: Config, estimates: Iterable[Estimate], count: int) -> list[Estimate]:
    """The first ``count`` estimates whose whole layout passes ``validate_config``: the enumeration validates
    one layout per (tp, cp, pp); what is shown or emitted is checked in full."""
    return list(islice((e for e in estimates if is_valid(cfg, e.layout)), count))


def is_valid(cfg: Config, layout: Layout) -> bool:
    try:
        validate_config(layout.apply(cfg), world_size=layout.world_size, check_paths=False)
    except ConfigError:
        return False
    return True


def evaluate(cfg: Config, layout: Layout, gpu: GPU, gpus_per_node: int,
             assumptions: TimingAssumptions = TimingAssumptions(), useful_flops: float | None = None) -> Estimate:
    """``layout`` estimated; ``useful_flops``: ``model_flops_per_step(cfg)``, the same for every layout of a search."""
    applied = layout.apply(cfg)
    memory = estimate_memory(applied, layout.dp, gpu)
    time = estimate_step_time(applied, layout.dp, gpu, gpus_per_node, assumptions)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    useful = model_flops_per_step(cfg) if useful_flops is None else useful_flops
    mfu = useful / (time.total * layout.world_size * gpu.peak_tflops * 1e12)
    return Estimate(layout, memory, time, memory.total <= gpu.memory_bytes, tokens / time.total, mfu)


def rank_layouts(cfg: Config, gpu: GPU, nodes: int, gpus_per_node: int,
                 assumptions: TimingAssumptions = TimingAssumptions(),
                 only: dict[str, Iterable] | None = None) -> list[Estimate]:
    """All valid layouts for ``nodes`` x ``gpus_per_node`` GPUs, estimated and ranked (see the module docstring)."""
    allowed = lambda key, value: not only or key not in only or value in set(only[key])  # noqa: E731
    estimates, useful = [], model_flops_per_step(cfg)
    for layout in candidate_layouts(cfg, nodes * gpus_per_node, only):
        estimates.append(evaluate(cfg, layout, gpu, gpus_per_node, assumptions, useful))
        if not estimates[-1].fits:
            estimates += [evaluate(cfg, saver, gpu, gpus_per_node, assumptions, useful) for saver in with_savers(layout)
                          if allowed("offload", saver.offload) and allowed("prefetch_depth", saver.prefetch_depth)]
    return sorted(_without_equal_zero_stages(estimates), key=_rank_key)


def _rank_key(est: Estimate) -> tuple:
    """Fitting layouts by step time (to 3 significant digits: closer than that is noise), then by memory;
    the others by memory."""
    if est.fits:
        return (0, float(f"{est.time.total:.3g}"), est.memory.total)
    return (1, est.memory.total, est.time.total)


def _without_equal_zero_stages(estimates: list[Estimate]) -> list[Estimate]:
    """Drop a ZeRO stage that costs exactly what a lower stage of the same layout costs (e.g. ZeRO-2 with
    several micro-batches, whose gradients stay whole all step): it would only repeat a row."""
    seen: dict = {}
    for est in sorted(estimates, key=lambda e: e.layout.zero_stage):
        key = (replace(est.layout, zero_stage=0), round(est.memory.total), round(est.time.total, 9))
        seen.setdefault(key, est)
    return list(seen.values())
