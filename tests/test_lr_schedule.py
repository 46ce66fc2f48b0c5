"""LRSchedule against hand-derived values and closed forms written in step units (not the code's t-form)."""
import io
import logging
import math

import pytest
import torch

from megatron_domino.config.errors import ConfigError
from megatron_domino.config.schema import OptimizerConfig
from megatron_domino.optim.lr_schedule import LRSchedule

MAX, MIN, W, D = 1.0, 0.1, 4, 12


def sched(style, **kw):
    args = dict(max_lr=MAX, min_lr=MIN, warmup_steps=W, decay_steps=D, style=style, wsd_decay_fraction=0.25)
    return LRSchedule(**{**args, **kw})


# Hand-computed with max 1.0, min 0.1, warm-up 4, decay 12 (cool-down 3 steps for wsd).
HAND = {
    "constant": {0: 0.0, 2: 0.5, 4: 1.0, 10: 1.0, 16: 1.0, 100: 1.0},
    "linear": {0: 0.0, 1: 0.25, 3: 0.75, 4: 1.0, 7: 0.775, 10: 0.55, 16: 0.1, 17: 0.1, 100: 0.1},
    "cosine": {0: 0.0, 3: 0.75, 4: 1.0, 8: 0.775, 10: 0.55, 12: 0.325, 16: 0.1, 100: 0.1},
    "wsd": {0: 0.0, 2: 0.5, 4: 1.0, 10: 1.0, 13: 1.0, 14: 0.7, 15: 0.4, 16: 0.1, 100: 0.1},
}


@pytest.mark.parametrize("style", sorted(HAND))
def test_hand_derived_values(style):
    s = sched(style)
    for step, expected in HAND[style].items():
        assert s.lr_at(step) == pytest.approx(expected, abs=1e-12), (style, step)


def reference(style, step, max_lr, min_lr, warmup, decay, frac):
    """Closed forms in step units, written from the definitions."""
    if step < warmup:
        return max_lr * step / warmup
    if style == "constant":
        return max_lr
    end = warmup + decay
    if step >= end:
        return min_lr
    if style == "linear":
        return min_lr + (max_lr - min_lr) * (end - step) / decay
    if style == "cosine":
        return min_lr + (max_lr - min_lr) * (1 + math.cos(math.pi * (step - warmup) / decay)) / 2
    cool = frac * decay
    if step <= end - cool:
        return max_lr
    return min_lr + (max_lr - min_lr) * (end - step) / cool


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "wsd"])
@pytest.mark.parametrize("warmup,decay,frac", [(7, 53, 0.3), (0, 20, 1.0), (1, 9, 0.5)])
def test_closed_form_at_every_step(style, warmup, decay, frac):
    s = LRSchedule(3e-4, 3e-5, warmup, decay, style, frac)
    for step in range(warmup + decay + 10):
        expected = reference(style, step, 3e-4, 3e-5, warmup, decay, frac)
        assert s.lr_at(step) == pytest.approx(expected, rel=1e-12, abs=1e-18), (style, step)


@pytest.mark.parametrize("style", ["linear", "cosine", "wsd"])
def test_boundaries(style):
    s = sched(style)
    assert s.lr_at(0) == 0.0
    assert s.lr_at(W - 1) == pytest.approx(MAX * (W - 1) / W)
    assert s.lr_at(W) == MAX
    assert MIN < s.lr_at(W + D - 1) < MAX
    assert s.lr_at(W + D) == pytest.approx(MIN, abs=1e-15)
    assert s.lr_at(W + D + 1000) == MIN


def test_zero_decay_steps_drops_to_min_after_warmup():
    s = LRSchedule(1.0, 0.2, 3, 0, "cosine")
    assert [s.lr_at(k) for k in range(6)] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 0.2, 0.2])


def test_step_and_current_lr():
    s = sched("linear")
    seen = [s.current_lr]
    for _ in range(5):
        seen.append(s.step())
    assert s.current_step == 5
    assert seen == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 0.925])


def test_from_config_defaults_decay_to_end_of_training():
    opt = OptimizerConfig(lr=2.0, min_lr=0.0, warmup_steps=5, decay_steps=None, lr_schedule="linear")
    s = LRSchedule.from_config(opt, train_steps=25)
    assert s.decay_steps == 20
    assert s.lr_at(15) == pytest.approx(1.0)
    assert s.lr_at(25) == 0.0
    explicit = LRSchedule.from_config(OptimizerConfig(warmup_steps=5, decay_steps=7), train_steps=25)
    assert explicit.decay_steps == 7


def test_from_config_rejects_warmup_longer_than_training():
    with pytest.raises(ConfigError, match="optimizer.warmup_steps = 30.*train.steps=25"):
        LRSchedule.from_config(OptimizerConfig(warmup_steps=30), train_steps=25)


def test_resume_mid_warmup_matches_uninterrupted():
    def make():
        return LRSchedule(6e-4, 6e-5, 7, 30, "cosine")

    straight = make()
    expected = [straight.current_lr] + [straight.step() for _ in range(40)]

    first = make()
    got = [first.current_lr] + [first.step() for _ in range(3)]
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = make()
    assert resumed.load_state_dict(torch.load(buffer, weights_only=True)) == []
    assert resumed.current_step == 3
    got += [resumed.step() for _ in range(37)]
    assert got == expected


def test_resume_with_changed_parameters_keeps_config_and_warns(caplog):
    old = LRSchedule(1.0, 0.0, 2, 10, "cosine")
    for _ in range(4):
        old.step()
    new = LRSchedule(0.5, 0.0, 2, 10, "linear")
    with caplog.at_level(logging.WARNING, logger="megatron_domino.optim.lr_schedule"):
        differences = new.load_state_dict(old.state_dict())
    assert sorted(d.split(":")[0] for d in differences) == ["max_lr", "style"]
    assert "config used" in caplog.text
    assert new.current_step == 4
    assert new.current_lr == pytest.approx(0.5 * (1 - 2 / 10))


def test_apply_respects_lr_mult():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr_mult": 0.1}], lr=123.0)
    s = sched("linear")
    for _ in range(2):
        s.step()
    assert s.apply(optimizer) == 0.5
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert optimizer.param_groups[1]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize("kwargs,message", [
    (dict(style="exp"), "optimizer.lr_schedule = 'exp'"),
    (dict(min_lr=2.0), "optimizer.min_lr = 2.0"),
    (dict(max_lr=0.0, min_lr=0.0), "optimizer.lr = 0.0"),
    (dict(warmup_steps=-1), "optimizer.warmup_steps = -1"),
    (dict(decay_steps=-2), "optimizer.decay_steps = -2"),
    (dict(wsd_decay_fraction=0.0), "optimizer.wsd_decay_fraction = 0.0"),
])
def test_invalid_settings_name_the_key(kwargs, message):
    with pytest.raises(ConfigError, match=message) as error:
        sched(**{"style": "cosine", **kwargs})
    assert "Fix:" in str(error.value)


def test_all_invalid_settings_are_reported_together():
    with pytest.raises(ConfigError) as error:
        LRSchedule(max_lr=1.0, min_lr=-1.0, warmup_steps=-3, decay_steps=10, style="exp")
    assert error.value.keys == ["optimizer.lr_schedule", "optimizer.min_lr", "optimizer.warmup_steps"]


def test_negative_step_is_refused():
    with pytest.raises(ValueError, match="step=-1"):
        sched("cosine").lr_at(-1)
