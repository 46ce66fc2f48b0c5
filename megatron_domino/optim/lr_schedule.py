"""Learning-rate schedule: linear warm-up, then a decay to ``min_lr`` over a fixed horizon.

The rate is a pure function of the step, so a resumed run only needs the step back to
continue the exact sequence an uninterrupted run would have produced.

Step convention (Megatron's): ``step`` counts the optimizer updates already done, so
update number ``step + 1`` uses ``lr_at(step)``. With W = warmup_steps, D = decay_steps
(the horizon *after* warm-up), and every style:

* ``step < W``: ``max_lr * step / W`` (the first update of a warm-up uses lr 0, as in Megatron);
* ``step >= W``: progress ``t = clamp((step - W) / D, 0, 1)`` (``D == 0``: ``t = 1`` past W) and

  - constant: ``max_lr`` (min_lr is not used);
  - linear:   ``min_lr + (max_lr - min_lr) * (1 - t)``;
  - cosine:   ``min_lr + (max_lr - min_lr) * 0.5 * (1 + cos(pi * t))``;
  - wsd (warmup-stable-decay): ``max_lr`` while ``t <= 1 - f``, then a linear cool-down that
    reaches ``min_lr`` at ``t = 1``; f = wsd_decay_fraction, the share of D spent cooling down.
    Linear (not inverse-sqrt) because it is Megatron's default WSD cool-down.

* After the horizon (``step >= W + D``) the decaying styles stay at ``min_lr``.

Resuming: ``state_dict`` records the step and the schedule's parameters. On load, the step is
restored and the *current* parameters win (as Megatron lets a resumed run override its
schedule); any difference is logged as a warning and returned, so the trainer can print it.
"""
from __future__ import annotations

import logging
import math

from ..config.errors import ConfigError, Problem
from ..config.schema import LR_SCHEDULES, OptimizerConfig

logger = logging.getLogger(__name__)

_PARAMETERS = ("max_lr", "min_lr", "warmup_steps", "decay_steps", "style", "wsd_decay_fraction")


class LRSchedule:
    """Step-based learning-rate schedule; ``apply`` writes the current rate into an optimizer."""

    def __init__(self, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                 style: str = "cosine", wsd_decay_fraction: float = 0.1):
        _raise_problems([
            (style in LR_SCHEDULES, "optimizer.lr_schedule", style, f"must be one of {', '.join(LR_SCHEDULES)}",
             "pick one of those names"),
            (max_lr > 0, "optimizer.lr", max_lr, "must be > 0", "set a positive peak learning rate"),
            (0 <= min_lr <= max_lr, "optimizer.min_lr", min_lr, f"must be in [0, optimizer.lr={max_lr}]",
             "lower min_lr or raise lr"),
            (warmup_steps >= 0, "optimizer.warmup_steps", warmup_steps, "must be >= 0", "use 0 for no warm-up"),
            (decay_steps >= 0, "optimizer.decay_steps", decay_steps, "must be >= 0",
             "set it to the number of steps after warm-up, or leave it unset"),
            (0 < wsd_decay_fraction <= 1, "optimizer.wsd_decay_fraction", wsd_decay_fraction, "must be in (0, 1]",
             "use e.g. 0.1 for a cool-down over the last 10% of the horizon"),
        ])
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.warmup_steps = int(warmup_steps)
        self.decay_steps = int(decay_steps)
        self.style = style
        self.wsd_decay_fraction = float(wsd_decay_fraction)
        self._step = 0

    @classmethod
    def from_config(cls, opt: OptimizerConfig, train_steps: int) -> "LRSchedule":
        """Build from the optimizer section; an unset ``decay_steps`` spans the rest of training."""
        decay_steps = opt.decay_steps
        if decay_steps is None:
            decay_steps = train_steps - opt.warmup_steps
            if decay_steps < 0:
                raise ConfigError("optimizer.warmup_steps", opt.warmup_steps,
                                  f"must not exceed train.steps={train_steps} when optimizer.decay_steps is unset",
                                  "lower warmup_steps, raise train.steps, or set optimizer.decay_steps")
        return cls(opt.lr, opt.min_lr, opt.warmup_steps, decay_steps, opt.lr_schedule, opt.wsd_decay_fraction)

    def lr_at(self, step: int) -> float:
        """The rate used by update number ``step + 1`` (see the module docstring for the formulas)."""
        if step < 0:
            raise ValueError(f"LRSchedule.lr_at: step={step} must be >= 0 (it counts updates already done)")
        if step < self.warmup_steps:
            return self.max_lr * step / self.warmup_steps
        if self.style == "constant":
            return self.max_lr
        past_warmup = step - self.warmup_steps
        t = min(past_warmup / self.decay_steps, 1.0) if self.decay_steps > 0 else float(past_warmup > 0)
        return self.min_lr + (self.max_lr - self.min_lr) * self._decay_coefficient(t)

    def _decay_coefficient(self, t: float) -> float:
        """Share of (max_lr - min_lr) left at decay progress t in [0, 1]."""
        if self.style == "linear":
            return 1.0 - t
        if self.style == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * t))
        stable_until = 1.0 - self.wsd_decay_fraction
        if t <= stable_until:
            return 1.0
        return (1.0 - t) / self.wsd_decay_fraction

    @property
    def current_step(self) -> int:
        return self._step

    @property
    def current_lr(self) -> float:
        return self.lr_at(self._step)

    def step(self) -> float:
        """Record one finished update; returns the rate for the next one."""
        self._step += 1
        return self.current_lr

    def apply(self, optimizer) -> float:
        """Write the current rate into every param group, times the group's ``lr_mult`` when it has one."""
        lr = self.current_lr
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        return lr

    def state_dict(self) -> dict:
        state = {name: getattr(self, name) for name in _PARAMETERS}
        state["step"] = self._step
        return state

    def load_state_dict(self, state: dict) -> list[str]:
        """Restore the step; keep this schedule's parameters and return (and log) those that differ."""
        if "step" not in state:
            raise KeyError("LRSchedule.load_state_dict: the checkpoint has no 'step' entry; it was not written by "
                           "LRSchedule.state_dict(). Fix: load a checkpoint saved by this trainer.")
        step = int(state["step"])
        if step < 0:
            raise ValueError(f"LRSchedule.load_state_dict: step={step} must be >= 0; the checkpoint is corrupt")
        self._step = step
        differences = [f"{name}: checkpoint {state[name]!r}, config {getattr(self, name)!r} (config used)"
                       for name in _PARAMETERS if name in state and state[name] != getattr(self, name)]
        for line in differences:
            logger.warning("LR schedule differs from the checkpoint's: %s", line)
        return differences


def _raise_problems(checks: list[tuple]) -> None:
    """Report every broken (ok, key, value, rule, fix) check at once, so one rerun fixes them all."""
    problems = [Problem(key, value, rule, fix) for ok, key, value, rule, fix in checks if not ok]
    if problems:
        raise ConfigError.of(problems)


__all__ = ["LRSchedule"]
