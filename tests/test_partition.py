"""Layer partitioning across (virtual) pipeline stages, with brute force as the reference for balancing."""
import random
from itertools import combinations

import pytest

from megatron_domino.config import ConfigError
from megatron_domino.pipeline.partition import partition_layers, stage_layers, uniform_counts


def counts(partition):
    return [len(stage) for stage in partition]


def assert_covers(partition, num_layers, stages):
    assert len(partition) == stages
    assert [layer for stage in partition for layer in stage] == list(range(num_layers))
    assert all(stage for stage in partition)


def brute_force(costs, stages, extra_first, extra_last):
    """(best bottleneck, best sum of squares at that bottleneck) over every contiguous non-empty split."""
    n, found = len(costs), []
    for cuts in combinations(range(1, n), stages - 1):
        bounds = (0,) + cuts + (n,)
        loads = [sum(costs[bounds[s]:bounds[s + 1]]) for s in range(stages)]
        loads[0] += extra_first
        loads[-1] += extra_last
        found.append((max(loads), sum(x * x for x in loads)))
    top = min(f[0] for f in found)
    return top, min(q for b, q in found if b <= top + 1e-9)


def loads_of(partition, costs, extra_first, extra_last):
    loads = [sum(costs[i] for i in stage) for stage in partition]
    loads[0] += extra_first
    loads[-1] += extra_last
    return loads


def test_uniform_is_even_and_the_suggested_layout_puts_the_remainder_in_the_middle():
    """The uniform split needs equal stages (the same rule validate_config applies: one home,
    ``check_partition``); for an uneven model the refusal suggests ``uniform_counts``'s layout."""
    assert partition_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert partition_layers(8, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ConfigError, match=r"model.num_layers = 30: must be divisible .*\(e\.g\. \[7, 8, 8, 7\]\)"):
        partition_layers(30, 4)
    assert uniform_counts(31, 4) == [8, 8, 8, 7]  # tie between the ends goes to the first
    assert uniform_counts(11, 5) == [2, 2, 3, 2, 2]
    for num_layers in range(1, 40):
        for stages in range(1, 16):
            if num_layers < stages:
                continue
            sizes = uniform_counts(num_layers, stages)
            assert sum(sizes) == num_layers and max(sizes) - min(sizes) <= 1
            centre = (stages - 1) / 2
            big = [s for s in range(stages) if sizes[s] > min(sizes)]
            small = [s for s in range(stages) if sizes[s] == min(sizes)]
            if big:  # every stage given an extra layer is at least as central as every stage without one
                assert max(abs(s - centre) for s in big) <= min(abs(s - centre) for s in small)


def test_parameters_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        n, stages = rng.randint(1, 9), rng.randint(1, 4)
        if n < stages:
            continue
        costs = [rng.choice([0.0, 0.5, 1.0, 2.0, rng.random() * 3]) for _ in range(n)]
        extra_first, extra_last = rng.random() * 2, rng.random() * 3
        part = partition_layers(n, stages, method="parameters", layer_costs=costs,
                                extra_first=extra_first, extra_last=extra_last)
        assert_covers(part, n, stages)
        loads = loads_of(part, costs, extra_first, extra_last)
        top, squares = brute_force(costs, stages, extra_first, extra_last)
        assert max(loads) == pytest.approx(top)
        assert sum(x * x for x in loads) == pytest.approx(squares)


def test_parameters_with_virtual_stages_and_head():
    # 32 equal layers, 4 stages, embedding worth 2 layers, head worth 4: loads 10, 10, 9, 9 at best.
    part = partition_layers(32, 2, 2, method="parameters", extra_first=2, extra_last=4)
    assert_covers(part, 32, 4)
    assert max(loads_of(part, [1.0] * 32, 2, 4)) == 10
    assert max(counts(partition_layers(30, 4, method="parameters"))) == 8


def test_explicit_layout_and_stage_layers():
    part = partition_layers(8, 2, 2, layout=[1, 3, 2, 2])
    assert part == [[0], [1, 2, 3], [4, 5], [6, 7]]
    # rank r, chunk c is virtual stage c * pp + r
    assert stage_layers(part, 0, 0, 2) == [0]
    assert stage_layers(part, 1, 0, 2) == [1, 2, 3]
    assert stage_layers(part, 0, 1, 2) == [4, 5]
    assert stage_layers(part, 1, 1, 2) == [6, 7]
    with pytest.raises(ValueError, match="pp_rank = 2"):
        stage_layers(part, 2, 0, 2)
    with pytest.raises(ValueError, match="chunk = 2"):
        stage_layers(part, 0, 2, 2)


@pytest.mark.parametrize("kwargs, words", [
    (dict(layout=[7, 7, 7, 7]), ["parallel.pipeline_layout = [7, 7, 7, 7]", "sums to 28 but model.num_layers = 30",
                                 "Fix: e.g. [7, 8, 8, 7]"]),
    (dict(layout=[15, 15]), ["parallel.pipeline_layout", "2 entries", "parallel.pp * parallel.virtual_pp", "Fix"]),
    (dict(layout=[0, 10, 10, 10]), ["parallel.pipeline_layout", "at least 1", "Fix"]),
    (dict(layout=[7.5, 7.5, 7, 8]), ["parallel.pipeline_layout", "integer", "Fix"]),
    (dict(layout=[7, 8, 8, 7], method="parameters"), ["parallel.pipeline_layout", "parallel.pipeline_partition"]),
    (dict(method="greedy"), ["parallel.pipeline_partition = 'greedy'", "Fix"]),
    (dict(method="parameters", layer_costs=[1.0] * 29), ["model.num_layers = 30", "29 layer costs", "fix"]),
    (dict(method="parameters", layer_costs=[-1.0] * 30), ["non-negative", "fix"]),
])
def test_partition_errors(kwargs, words):
    with pytest.raises(ValueError) as err:
        partition_layers(30, 4, **kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_too_few_layers_and_bad_sizes():
    with pytest.raises(ValueError, match=r"model.num_layers = 6: .*parallel.pp \* parallel.virtual_pp = 4 \* 2 = 8"):
        partition_layers(6, 4, 2)
    with pytest.raises(ValueError, match="parallel.pp = 0"):
        partition_layers(6, 0)
