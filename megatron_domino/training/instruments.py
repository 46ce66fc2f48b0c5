"""What watches a run, each built from its ``log`` settings: the metrics writer, timers, the profiler window,
the out-of-memory snapshot and the straggler report (the last two None when off)."""
from __future__ import annotations

from ..config.loader import config_to_dict
from .metrics import MetricsWriter, Timers
from .profiling import OomSnapshot, ProfileWindow
from .straggler import StragglerReport


def build_instruments(cfg, state, device, writes_metrics: bool) -> tuple:
    """(metrics, timers, profile window or None, OOM snapshot, straggler report or None) of this rank;
    ``writes_metrics``: this rank writes the JSONL / TensorBoard / wandb records."""
    log = cfg.log
    wandb = (log.wandb_project, log.wandb_mode, config_to_dict(cfg)) if log.wandb_project else None
    metrics = MetricsWriter(log.dir, writes_metrics, log.tensorboard, wandb)
    profile = (ProfileWindow(log.profile_steps, log.dir, state.rank, device, log.profile_memory,
                             keep_history=log.oom_snapshot) if log.profile_steps else None)
    stragglers = StragglerReport(state, log.straggler_interval, device, log.dir) if log.straggler_interval else None
    return (metrics, Timers(device, synchronize=log.timers), profile,
            OomSnapshot(log.dir, state.rank, device, log.oom_snapshot), stragglers)
