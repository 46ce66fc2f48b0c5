"""Memoised functions of a config's model and layout: a planner search asks for the same few values thousands of
times (``memory``, ``timing``, ``optimizer_state``)."""
from __future__ import annotations

from functools import wraps

from ..config.schema import Config
from ..pipeline.schedules import v_shape
from ..pipeline.stages import layer_partition


def _model_key(model) -> tuple:
    """The model section's values as a dictionary key (lists, such as moe_layer_freq, as tuples)."""
    values = tuple(vars(model).values())
    try:
        hash(values)  # the common case, and a search builds tens of thousands of keys
    except TypeError:
        return tuple(tuple(v) if isinstance(v, list) else v for v in values)
    return values


def per_model_layout(fn):
    """Memoise ``fn(cfg)``, a function of the model, its pipeline split and placement (the V or not) and tp / ep only:
    a search asks for the same few values thousands of times. Results are shared, so they are tuples."""
    results: dict = {}

    @wraps(fn)
    def memoised(cfg: Config):
        par = cfg.parallel
        key = (_model_key(cfg.model), par.tp, par.pp, par.ep, par.expert_tp, par.virtual_pp, par.pipeline_partition,
               tuple(par.pipeline_layout or ()), v_shape(par.pipeline_schedule))  # the V places chunks otherwise
        if key not in results:
            results[key] = fn(cfg)
        return results[key]

    return memoised


@per_model_layout
def stage_layers(cfg: Config) -> tuple:
    """``layer_partition``, memoised."""
    return tuple(tuple(layers) for layers in layer_partition(cfg))
