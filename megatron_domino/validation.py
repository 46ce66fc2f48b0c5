"""Every rule of a run, checked on one CPU process before any process group starts.

A bad layout found after 512 ranks have started costs minutes and prints 512 tracebacks; found here
it costs nothing and names the key. All problems are collected and raised together (one line each,
"<key> = <value>: <rule>. Fix: <fix>"); settings that work but surprise are returned as warnings.

Each rule has one home, next to what it governs, and every user of it calls that one function: the
rank grid (``parallel.topology.check_topology``, also run by ``Topology``), Domino
(``domino.plan.check_domino``, also run by ``DominoPlan``), the pipeline split and schedule
(``pipeline.partition.check_partition`` and ``pipeline.schedules.check_schedule``, also run when a
partition or a schedule is built, and by the planner's search), the config's own sections
(``config/rules.py``), what TP splits (``models.attention``, ``models.mlp``), MoE (``config/validate_moe.py``), the
evaluation's samples (``config/validate_samples.py``).
This module only gathers them.
"""
from __future__ import annotations

from .config import rules
from .config.checks import Checks
from .config.errors import ConfigError
from .config.loader import config_from_dict, config_to_dict
from .config.schema import Config
from .config.validate_data import check_data, check_eval_sets
from .config.validate_samples import check_samples
from .config.validate_moe import check_moe
from .domino.plan import check_domino
from .models.attention import check_attention_split
from .models.mlp import check_mlp_split
from .parallel.topology import check_topology
from .pipeline.partition import check_partition
from .pipeline.schedules import check_f_and_b, check_schedule


def validate_config(cfg: Config, world_size: int | None = None, check_paths: bool = True,
                    device_type: str | None = None) -> list[str]:
    """Check every rule; raise one ``ConfigError`` listing all problems, or return the warnings.

    ``world_size`` (when known) checks tp * cp * pp * dp against it; ``check_paths`` checks that the data,
    tokenizer and checkpoint files exist; ``device_type`` ("cuda" or "cpu", when known) checks what only
    one kind of device refuses. Configs built in code get the loader's type checks too.
    """
    cfg = config_from_dict(config_to_dict(cfg))
    p, c = cfg.parallel, Checks()
    rules.check_model(c, cfg, device_type)
    dp = check_topology(c, world_size, p.tp, p.pp, p.dp, p.virtual_pp, p.order, p.cp, p.ep, p.expert_tp)
    check_domino(c, p.domino, p.domino_chunks, p.domino_split, p.domino_overlap, cfg.train.micro_batch_size)
    rules.check_parallel(c, cfg)
    if isinstance(p.tp, int) and p.tp >= 1:  # else check_topology named it
        check_attention_split(c, cfg.model, p.tp)
        check_mlp_split(c, cfg.model, p.tp)
    micro_batches = rules.check_train(c, cfg, dp)
    if p.pp >= 1 and p.virtual_pp >= 1:  # else check_topology named them
        if cfg.model.num_layers >= 1:
            check_partition(c, cfg.model.num_layers, p.pp, p.virtual_pp, p.pipeline_partition, p.pipeline_layout)
        check_schedule(c, p.pp, p.virtual_pp, micro_batches, p.pipeline_schedule)
    check_f_and_b(c, p, rules.f_and_b_turns(p))
    check_moe(c, cfg)
    rules.check_optimizer(c, cfg)
    check_data(c, cfg, check_paths)
    check_eval_sets(c, cfg, check_paths)
    rules.check_files(c, cfg, check_paths)
    rules.check_operations(c, cfg)
    check_samples(c, cfg)
    if c.problems:
        raise ConfigError.of(c.problems)
    return c.warnings
