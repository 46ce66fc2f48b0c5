"""Which transformer layers each virtual pipeline stage holds.

Virtual stage ``s`` lives on rank ``s % pp`` as chunk ``s // pp``; every stage
holds a contiguous, non-empty run of layers and together they cover each layer
exactly once, so checkpoints can be resharded by layer index alone.
"""
from __future__ import annotations

from itertools import accumulate

from ..config.checks import Checks
from ..config.schema import PIPELINE_PARTITIONS
from .program import virtual_stage


def _counts_to_layers(counts: list[int]) -> list[list[int]]:
    starts = [0] + list(accumulate(counts))
    return [list(range(starts[i], starts[i + 1])) for i in range(len(counts))]


def uniform_counts(num_layers: int, num_stages: int) -> list[int]:
    """Equal layer counts; the remainder goes one layer each to the stages nearest the middle.

    The first stage also holds the embedding and the last the output head, so the
    extra layers go where the least other work is. Ties go to the earlier stage
    (the embedding lookup is cheaper than the head's matmul and loss).
    """
    base, extra = divmod(num_layers, num_stages)
    centre = (num_stages - 1) / 2
    favoured = sorted(range(num_stages), key=lambda s: (abs(s - centre), s))[:extra]
    return [base + (s in favoured) for s in range(num_stages)]


def _best_split(n: int, num_stages: int, stage_cost, combine) -> tuple[float, list[int]]:
    """Contiguous split of n layers into non-empty stages minimising a fold of the stage costs.

    ``combine(prefix_value, stage_cost)`` must be monotone and at least ``combine(0, stage_cost)``, which is
    what makes the prefix DP exact and lets it stop once a stage alone is too costly.
    """
    inf = float("inf")
    # best[k][j]: best value putting the first j layers on stages 0..k-1; cut[k][j]: where stage k-1 starts.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(j - 1, k - 2, -1):
                last = stage_cost(k - 1, i, j)
                if combine(0.0, last) >= best[k][j]:
                    break  # starting the stage earlier only makes it costlier
                value = combine(best[k - 1][i], last)
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    counts, j = [], n
    for k in range(num_stages, 0, -1):
        counts.append(j - cut[k][j])
        j = cut[k][j]
    return best[num_stages][n], counts[::-1]


def balanced_counts(costs: list[float], num_stages: int, extra_first: float = 0.0,
                    extra_last: float = 0.0) -> list[int]:
    """Contiguous split of ``costs`` into ``num_stages`` non-empty runs minimising the costliest stage.

    Stage 0 is charged ``extra_first`` (embedding) and the last stage ``extra_last`` (head). The bottleneck
    sets the pipeline's speed, but many splits share it; among those the one with the smallest sum of squared
    stage costs is taken, so the other stages are balanced too instead of some being left nearly empty.
    """
    prefix = [0.0] + list(accumulate(costs))

    def stage_cost(stage: int, lo: int, hi: int) -> float:
        return (prefix[hi] - prefix[lo] + (extra_first if stage == 0 else 0.0)
                + (extra_last if stage == num_stages - 1 else 0.0))

    bottleneck, _ = _best_split(len(costs), num_stages, stage_cost, max)
    cap = bottleneck * (1 + 1e-9) + 1e-12  # float slack so the optimum itself stays allowed
    _, counts = _best_split(len(costs), num_stages, stage_cost,
                            lambda before, c: before + c * c if c <= cap else float("inf"))
    return counts


def check_partition(c: Checks, num_layers: int, pp: int, virtual_pp: int, method: str = "uniform",
                    layout=None) -> None:
    """The rules of ``parallel.pipeline_layout`` / ``pipeline_partition``: every virtual stage gets at least one
    layer and every layer one stage; the uniform split needs equal stages (Megatron's rule), an uneven model
    takes ``parameters`` or an explicit layout. ``validate_config`` runs these, and so does ``partition_layers``."""
    if not all([c.positive("parallel.pp", pp), c.positive("parallel.virtual_pp", virtual_pp)]):
        return
    stages = pp * virtual_pp
    need = f"parallel.pp * parallel.virtual_pp = {pp} * {virtual_pp} = {stages} virtual stages"
    hint = (f"e.g. {uniform_counts(num_layers, stages)}" if num_layers >= stages
            else "lower parallel.pp or parallel.virtual_pp so every stage can get a layer")
    if layout is not None:
        key = "parallel.pipeline_layout"
        if method != "uniform":
            c.fail(key, layout, f"fixes the split, so parallel.pipeline_partition = {method!r} cannot also balance it",
                   "drop one of the two settings")
        elif not isinstance(layout, (list, tuple)) or not all(isinstance(n, int) and not isinstance(n, bool)
                                                              for n in layout):
            c.fail(key, layout, "must be a list of integer layer counts, one per virtual stage", hint)
        elif len(layout) != stages:
            c.fail(key, layout, f"has {len(layout)} entries but {need} need one each", hint)
        elif any(n < 1 for n in layout):
            c.fail(key, layout, f"gives a stage {min(layout)} layers but every stage needs at least 1", hint)
        elif sum(layout) != num_layers:
            c.fail(key, layout, f"sums to {sum(layout)} but model.num_layers = {num_layers}; every layer must be "
                   f"placed exactly once", hint)
        return
    c.one_of("parallel.pipeline_partition", method, PIPELINE_PARTITIONS)
    if num_layers < stages:
        c.fail("model.num_layers", num_layers, f"cannot fill {need} with at least one layer each",
               "lower parallel.pp or parallel.virtual_pp, or raise model.num_layers")
    elif method == "uniform" and num_layers % stages:
        c.fail("model.num_layers", num_layers, f"must be divisible by {need} for the uniform split",
               f"change model.num_layers or parallel.pp, or use parallel.pipeline_partition=parameters or an "
               f"explicit parallel.pipeline_layout ({hint})")


def partition_layers(num_layers: int, pp: int, virtual_pp: int = 1, method: str = "uniform",
                     layout: list[int] | None = None, layer_costs: list[float] | None = None,
                     extra_first: float = 0.0, extra_last: float = 0.0) -> list[list[int]]:
    """Global layer indices held by each virtual stage 0..pp*virtual_pp-1 (contiguous, in order).

    ``layout`` (parallel.pipeline_layout) fixes the layer count per virtual stage and wins over ``method``.
    "uniform" splits evenly; "parameters" (parallel.pipeline_partition) balances ``layer_costs`` (default 1
    per layer) plus ``extra_first``/``extra_last`` for the embedding and head. A layout that breaks
    ``check_partition`` raises its ``ConfigError``.
    """
    c = Checks()
    check_partition(c, num_layers, pp, virtual_pp, method, layout)
    c.raise_problems()
    stages = pp * virtual_pp
    if layout is not None:
        return _counts_to_layers(list(layout))
    if method == "uniform":
        return _counts_to_layers(uniform_counts(num_layers, stages))
    costs = [1.0] * num_layers if layer_costs is None else [float(n) for n in layer_costs]
    if len(costs) != num_layers or any(n < 0 for n in costs) or min(extra_first, extra_last) < 0:
        raise ValueError(f"parallel.pipeline_partition = 'parameters' needs one non-negative cost per layer "
                         f"(model.num_layers = {num_layers}) and non-negative embedding/head extras, got "
                         f"{len(costs)} layer costs, extra_first = {extra_first}, extra_last = {extra_last}; "
                         f"fix: pass the per-layer parameter counts")
    return _counts_to_layers(balanced_counts(costs, stages, extra_first, extra_last))


def stage_layers(partition: list[list[int]], pp_rank: int, chunk: int, pp: int, v_shape: bool = False) -> list[int]:
    """Layers of model ``chunk`` on pipeline rank ``pp_rank`` (``v_shape``: the V schedules' layout)."""
    virtual_pp = len(partition) // pp if pp > 0 else 0
    if virtual_pp < 1 or len(partition) != pp * virtual_pp or not (0 <= pp_rank < pp and 0 <= chunk < virtual_pp):
        raise ValueError(f"pp_rank = {pp_rank}, chunk = {chunk} do not fit a partition of {len(partition)} "
                         f"virtual stages with parallel.pp = {pp}; fix: pass the partition built for this "
                         f"parallel.pp, 0 <= pp_rank < pp and 0 <= chunk < parallel.virtual_pp")
    return partition[virtual_stage(pp_rank, chunk, pp, v_shape)]
