"""Enumerate every valid layout for a cluster, estimate each, and rank them.

A layout is (tp, pp, dp, virtual pp, micro batch, recompute, ZeRO stage) plus how TP communicates:
Domino's overlap or sequence parallelism (they do not combine). Every candidate goes through
``validate_config`` (without file checks) so the planner can never suggest a layout the trainer
would refuse. Ranking: layouts that fit first, fastest first (ties within 3 significant digits go
to the one with less memory); then the ones that do not fit, smallest memory first (the nearest
misses say what to change).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import islice, product
from typing import Iterable

from ..config.errors import ConfigError
from ..config.schema import RECOMPUTE, ZERO_STAGES, Config
from ..config.validate import validate_config
from .hardware import GPU
from .memory import StageMemory, estimate_memory
from .timing import StepTime, TimingAssumptions, estimate_step_time, model_flops_per_step

MICRO_BATCHES = (1, 2, 4, 8)
MAX_TP = 64


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    virtual_pp: int
    micro_batch: int
    recompute: str
    zero_stage: int
    sequence_parallel: bool
    domino: bool

    @property
    def tp_mode(self) -> str:
        domino = self.domino and self.tp > 1
        return "sp+domino" if self.sequence_parallel and domino else "sp" if self.sequence_parallel else \
            "domino" if domino else "-"

    def overrides(self) -> list[str]:
        """The layout as ``section.key=value`` overrides for the loader and the entry points."""
        flag = lambda v: "true" if v else "false"  # noqa: E731
        return [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.dp={self.dp}",
                f"parallel.virtual_pp={self.virtual_pp}", f"parallel.sequence_parallel={flag(self.sequence_parallel)}",
                f"parallel.domino={flag(self.domino)}", f"train.micro_batch_size={self.micro_batch}",
                f"model.recompute={self.recompute}", f"optimizer.zero_stage={self.zero_stage}"]

    def apply(self, cfg: Config) -> Config:
        return replace(cfg,
                       model=replace(cfg.model, recompute=self.recompute),
                       parallel=replace(cfg.parallel, tp=self.tp, pp=self.pp, dp=self.dp, virtual_pp=self.virtual_pp,
                                        sequence_parallel=self.sequence_parallel, domino=self.domino,
                                        pipeline_layout=None),
                       train=replace(cfg.train, micro_batch_size=self.micro_batch),
                       optimizer=replace(cfg.optimizer, zero_stage=self.zero_stage))


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: StageMemory  # the pipeline rank with the most memory
    time: StepTime
    fits: bool
    tokens_per_s: float
    mfu: float


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_modes(tp: int, domino: bool) -> list[tuple[bool, bool]]:
    """(sequence_parallel, domino) choices: Domino as configured, and with tp > 1 sequence parallelism
    with and without it."""
    if tp == 1:
        return [(False, domino)]
    return [(False, domino), (True, False)] + ([(True, True)] if domino else [])


def candidate_layouts(cfg: Config, world_size: int, only: dict[str, Iterable] | None = None) -> list[Layout]:
    """Every layout of ``world_size`` GPUs that ``validate_config`` accepts; ``only`` restricts fields of Layout."""
    only = {key: set(values) for key, values in (only or {}).items()}
    unknown = set(only) - set(Layout.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown layout field(s) {sorted(unknown)}; valid: {', '.join(Layout.__dataclass_fields__)}")
    allowed = lambda key, value: key not in only or value in only[key]  # noqa: E731
    layers, batch = cfg.model.num_layers, cfg.train.global_batch_size
    found = []
    for tp in [t for t in _divisors(world_size) if t <= MAX_TP and allowed("tp", t)]:
        for pp in [p for p in _divisors(world_size // tp) if p <= layers and allowed("pp", p)]:
            dp = world_size // (tp * pp)
            virtual = _divisors(layers // pp) if pp > 1 else [1]
            shape = product([v for v in virtual if allowed("virtual_pp", v)],
                            [b for b in MICRO_BATCHES if batch % (b * dp) == 0 and allowed("micro_batch", b)],
                            _tp_modes(tp, cfg.parallel.domino))
            for v, micro, (sp, domino) in shape:
                if not (allowed("sequence_parallel", sp) and allowed("domino", domino)):
                    continue
                base = Layout(tp, pp, dp, v, micro, cfg.model.recompute, cfg.optimizer.zero_stage, sp, domino)
                if not is_valid(cfg, base):
                    continue
                stages = ZERO_STAGES if dp > 1 else (cfg.optimizer.zero_stage,)  # one DP rank: the stage is moot
                for recompute, zero in product(RECOMPUTE, stages):
                    if allowed("recompute", recompute) and allowed("zero_stage", zero):
                        found.append(replace(base, recompute=recompute, zero_stage=zero))
    return found


def first_valid(cfg: Config, estimates: Iterable[Estimate], count: int) -> list[Estimate]:
    """The first ``count`` estimates whose whole layout passes ``validate_config``. The enumeration validates
    each shape once with the config's recompute and ZeRO stage; what is shown or emitted is checked in full."""
    return list(islice((e for e in estimates if is_valid(cfg, e.layout)), count))


def is_valid(cfg: Config, layout: Layout) -> bool:
    try:
        validate_config(layout.apply(cfg), world_size=layout.tp * layout.pp * layout.dp, check_paths=False)
    except ConfigError:
        return False
    return True


def evaluate(cfg: Config, layout: Layout, gpu: GPU, gpus_per_node: int,
             assumptions: TimingAssumptions = TimingAssumptions()) -> Estimate:
    applied = layout.apply(cfg)
    memory = estimate_memory(applied, layout.dp, gpu)
    time = estimate_step_time(applied, layout.dp, gpu, gpus_per_node, assumptions)
    world = layout.tp * layout.pp * layout.dp
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    mfu = model_flops_per_step(applied) / (time.total * world * gpu.peak_tflops * 1e12)
    return Estimate(layout, memory, time, memory.total <= gpu.memory_bytes, tokens / time.total, mfu)


def rank_layouts(cfg: Config, gpu: GPU, nodes: int, gpus_per_node: int,
                 assumptions: TimingAssumptions = TimingAssumptions(),
                 only: dict[str, Iterable] | None = None) -> list[Estimate]:
    """All valid layouts for ``nodes`` x ``gpus_per_node`` GPUs, estimated and ranked (see the module docstring)."""
    estimates = [evaluate(cfg, layout, gpu, gpus_per_node, assumptions)
                 for layout in candidate_layouts(cfg, nodes * gpus_per_node, only)]
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
