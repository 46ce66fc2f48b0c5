"""A layout the planner estimates: the sizes and settings it varies, as config overrides and applied to a config.

A layout is (tp, cp, pp, dp, virtual pp, pipeline schedule, micro batch, recompute, ZeRO stage and its savers) plus
how TP communicates (Domino's overlap, sequence parallelism, or both), how CP does (``parallel.cp_comm``) and, for
an MoE model, the expert-parallel size. ``planner/search.py`` enumerates them.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config.schema import Config
from ..pipeline.schedules import schedule_kind


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
    cp: int = 1
    ep: int = 1  # expert parallel: data-parallel ranks that share out the experts (MoE models only)
    offload: bool = False  # optimizer.offload=cpu (the config's offload_fraction)
    prefetch_depth: int = 1  # ZeRO-3's layers gathered ahead
    cp_comm: str = "ring"  # how attention spans the CP ranks (parallel.cp_comm; moot at cp 1)
    cp_a2a_size: int | None = None  # a2a+ring: CP ranks per all-to-all group
    schedule: str | None = None  # parallel.pipeline_schedule: named at pp > 1 (``schedule_choices``), else the config's

    @property
    def zero_mode(self) -> str:
        """The ZeRO stage with its savers, e.g. '3', '3p0' (no prefetch), '1+cpu' (offloaded)."""
        prefetch = f"p{self.prefetch_depth}" if self.zero_stage == 3 and self.prefetch_depth != 1 else ""
        return f"{self.zero_stage}{prefetch}{'+cpu' if self.offload else ''}"

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def tp_mode(self) -> str:
        domino = self.domino and self.tp > 1
        return "sp+domino" if self.sequence_parallel and domino else "sp" if self.sequence_parallel else \
            "domino" if domino else "-"

    @property
    def cp_mode(self) -> str:
        """'ring', 'a2a' or 'a2a4+ring' (all-to-alls in groups of 4, a ring across them); '-' without CP."""
        if self.cp == 1:
            return "-"
        return f"a2a{self.cp_a2a_size}+ring" if self.cp_comm == "a2a+ring" else self.cp_comm

    @property
    def schedule_mode(self) -> str:
        """The pipeline schedule that runs ('1f1b', 'zb-v', ...); '-' without a pipeline."""
        kind = schedule_kind(self.pp, self.virtual_pp, self.schedule)
        return "-" if kind == "none" else kind

    def overrides(self) -> list[str]:
        """The layout as ``section.key=value`` overrides for the loader and the entry points."""
        flag = lambda v: "true" if v else "false"  # noqa: E731
        return [f"parallel.tp={self.tp}", f"parallel.cp={self.cp}", f"parallel.pp={self.pp}", f"parallel.dp={self.dp}",
                f"parallel.ep={self.ep}", f"parallel.virtual_pp={self.virtual_pp}",
                f"parallel.pipeline_schedule={self.schedule or 'null'}",
                f"parallel.cp_comm={self.cp_comm}", f"parallel.cp_a2a_size={self.cp_a2a_size or 'null'}",
                f"parallel.sequence_parallel={flag(self.sequence_parallel)}",
                f"parallel.domino={flag(self.domino)}", f"train.micro_batch_size={self.micro_batch}",
                f"model.recompute={self.recompute}", f"optimizer.zero_stage={self.zero_stage}",
                f"optimizer.offload={'cpu' if self.offload else 'null'}",
                f"optimizer.prefetch_depth={self.prefetch_depth}"]

    def apply(self, cfg: Config) -> Config:
        return updated(cfg,
                        model=updated(cfg.model, recompute=self.recompute),
                        parallel=updated(cfg.parallel, tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp, ep=self.ep,
                                          virtual_pp=self.virtual_pp, sequence_parallel=self.sequence_parallel,
                                          domino=self.domino, pipeline_layout=None, cp_comm=self.cp_comm,
                                          cp_a2a_size=self.cp_a2a_size, pipeline_schedule=self.schedule),
                        train=updated(cfg.train, micro_batch_size=self.micro_batch),
                        optimizer=updated(cfg.optimizer, zero_stage=self.zero_stage,
                                           prefetch_depth=self.prefetch_depth, offload="cpu" if self.offload else None))


def updated(section, **changes):
    """``dataclasses.replace`` for the config's plain dataclasses without re-running ``__init__``: ten times
    faster, and a search applies tens of thousands of layouts."""
    new = object.__new__(type(section))
    new.__dict__.update(vars(section), **changes)
    return new
