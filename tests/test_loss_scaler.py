"""Loss scalers against traces derived by hand from Megatron's rules, and the non-finite gradient check."""
import io
import math

import pytest
import torch
import torch.distributed as dist

from megatron_domino.config.errors import ConfigError
from megatron_domino.config.schema import OptimizerConfig
from megatron_domino.optim.loss_scaler import (
    ConstantLossScaler,
    DynamicLossScaler,
    found_inf_across_ranks,
    loss_scaler_from_config,
)

INF, CLEAN = True, False

# initial 8, growth every 3 clean steps, backoff 0.5, hysteresis 2, floor 1. Derivation (scale, growth, hysteresis):
#  1 inf  -> h=1 > 0, no backoff            8    9..11 clean -> 3rd grows, h=2    8 (after 11)
#  2 ok   -> g=1                            8    12 inf -> h=1                     8
#  3 inf  -> g=0, h=0 -> backoff            4    13 inf -> h=0 -> backoff          4
#  4 inf  -> h=-1 -> backoff                2    14 inf -> 2, 15 inf -> 1
#  5,6 ok -> g=1,2                          2    16 inf -> 0.5 floored at 1        1
#  7 ok   -> g=3: grow, h=2, g=0            4
#  8 inf  -> h=1                            4
TRACE_EVENTS = [INF, CLEAN, INF, INF, CLEAN, CLEAN, CLEAN, INF, CLEAN, CLEAN, CLEAN, INF, INF, INF, INF, INF]
TRACE_SCALES = [8, 8, 4, 2, 2, 2, 4, 4, 4, 4, 8, 8, 4, 2, 1, 1]


def make_scaler():
    return DynamicLossScaler(initial_scale=8.0, growth_interval=3, backoff_factor=0.5, hysteresis=2, min_scale=1.0)


def test_dynamic_trace_matches_hand_derivation():
    scaler = make_scaler()
    scales = []
    for found_inf in TRACE_EVENTS:
        scaler.update(found_inf)
        scales.append(scaler.scale)
    assert scales == TRACE_SCALES
    assert scaler.skipped_steps == sum(TRACE_EVENTS) == 9
    assert scaler.inv_scale == 1.0


def test_hysteresis_one_and_custom_growth_factor():
    # Every overflow backs off; two clean steps multiply by 3.
    scaler = DynamicLossScaler(4.0, growth_interval=2, backoff_factor=0.25, hysteresis=1, min_scale=0.5,
                               growth_factor=3.0)
    events = [INF, CLEAN, CLEAN, CLEAN, INF, INF, CLEAN, CLEAN]
    expected = [1.0, 1.0, 3.0, 3.0, 0.75, 0.5, 0.5, 1.5]
    got = []
    for found_inf in events:
        scaler.update(found_inf)
        got.append(scaler.scale)
    assert got == expected


def test_overflow_interrupts_growth_window():
    scaler = DynamicLossScaler(2.0, growth_interval=2, backoff_factor=0.5, hysteresis=5, min_scale=1.0)
    for found_inf in [CLEAN, INF, CLEAN]:
        scaler.update(found_inf)
    assert scaler.scale == 2.0  # the overflow reset the clean count, so only one clean step since
    scaler.update(CLEAN)
    assert scaler.scale == 4.0


def test_state_dict_round_trip_resumes_the_trace():
    first = make_scaler()
    for found_inf in TRACE_EVENTS[:8]:
        first.update(found_inf)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = make_scaler()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert (resumed.scale, resumed.skipped_steps) == (4.0, 4)
    scales = []
    for found_inf in TRACE_EVENTS[8:]:
        resumed.update(found_inf)
        scales.append(resumed.scale)
    assert scales == TRACE_SCALES[8:]
    assert resumed.skipped_steps == 9


def test_load_state_dict_names_missing_key():
    with pytest.raises(KeyError, match="'hysteresis_tracker'"):
        make_scaler().load_state_dict({"scale": 2.0, "skipped_steps": 0, "growth_tracker": 0})
    with pytest.raises(ValueError, match="scale=inf"):
        make_scaler().load_state_dict({"scale": math.inf, "skipped_steps": 0, "growth_tracker": 0,
                                       "hysteresis_tracker": 2})


@pytest.mark.parametrize("kwargs,message", [
    (dict(backoff_factor=1.5), "optimizer.loss_scale_backoff"),
    (dict(min_scale=16.0), "optimizer.min_loss_scale"),
    (dict(hysteresis=0), "optimizer.hysteresis"),
    (dict(growth_interval=0), "optimizer.loss_scale_window"),
    (dict(growth_factor=1.0), "growth_factor = 1.0"),
])
def test_invalid_settings_name_the_key(kwargs, message):
    args = dict(initial_scale=8.0, growth_interval=3, backoff_factor=0.5, hysteresis=2, min_scale=1.0)
    with pytest.raises(ConfigError, match=message) as error:
        DynamicLossScaler(**{**args, **kwargs})
    assert "Fix:" in str(error.value)


def test_constant_scaler_is_a_no_op_that_counts_skips():
    scaler = ConstantLossScaler()
    for found_inf in [INF, CLEAN, INF]:
        scaler.update(found_inf)
    assert (scaler.scale, scaler.inv_scale, scaler.skipped_steps) == (1.0, 1.0, 2)
    fresh = ConstantLossScaler()
    fresh.load_state_dict(scaler.state_dict())
    assert (fresh.scale, fresh.skipped_steps) == (1.0, 2)


def test_from_config_picks_scaler_by_precision():
    opt = OptimizerConfig(initial_loss_scale=1024.0, loss_scale_window=7, loss_scale_backoff=0.25, hysteresis=3,
                          min_loss_scale=2.0)
    dynamic = loss_scaler_from_config(opt, fp16=True)
    assert isinstance(dynamic, DynamicLossScaler)
    assert (dynamic.scale, dynamic.growth_interval, dynamic.backoff_factor, dynamic.hysteresis,
            dynamic.min_scale) == (1024.0, 7, 0.25, 3, 2.0)
    constant = loss_scaler_from_config(opt, fp16=False)
    assert isinstance(constant, ConstantLossScaler) and constant.scale == 1.0


def grads(*values, dtype=torch.float32):
    return [torch.tensor(v, dtype=dtype) for v in values]


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_found_inf_single_process(bad):
    assert found_inf_across_ranks(grads([1.0, 2.0], [3.0])) is False
    assert found_inf_across_ranks(grads([1.0, 2.0], [3.0, bad])) is True
    assert found_inf_across_ranks([None] + grads([bad], dtype=torch.bfloat16) + grads([1.0])) is True
    assert found_inf_across_ranks(grads([1.0], dtype=torch.float16) + grads([bad], dtype=torch.float32)) is True


def test_found_inf_without_grads_is_false():
    assert found_inf_across_ranks([]) is False
    assert found_inf_across_ranks([None, None]) is False


def test_unscale_in_the_same_pass():
    fp32, fp16 = torch.tensor([3.0, -6.0]), torch.tensor([1.5], dtype=torch.float16)
    assert found_inf_across_ranks([fp32, None, fp16], inv_scale=1 / 4) is False
    assert fp32.tolist() == [0.75, -1.5]
    assert fp16.dtype == torch.float16 and fp16.tolist() == [0.375]
    untouched = torch.tensor([5.0, 7.0])
    found_inf_across_ranks([untouched])
    assert untouched.tolist() == [5.0, 7.0]


def test_found_inf_all_reduces_over_a_one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert found_inf_across_ranks(grads([1.0])) is False
        assert found_inf_across_ranks(grads([math.nan]), group=dist.group.WORLD) is True
        assert found_inf_across_ranks([]) is False
    finally:
        dist.destroy_process_group()


def test_an_overflow_on_another_rank_makes_this_rank_skip(tmp_path, monkeypatch):
    """Stand in for a second rank by replacing the all-reduce with one that mixes in its overflow flag."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    calls = []

    def all_reduce_with_remote_overflow(tensor, op, group=None):
        calls.append((op, group))
        tensor.copy_(torch.maximum(tensor, torch.ones_like(tensor)))

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "all_reduce", all_reduce_with_remote_overflow)
        assert found_inf_across_ranks(grads([1.0]), group=dist.group.WORLD) is True
        assert calls == [(dist.ReduceOp.MAX, dist.group.WORLD)]
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
