"""Loss scaling for fp16 training, and the cross-rank "did any gradient overflow?" check.

fp16 gradients underflow unless the loss is multiplied by a large scale before backward;
too large a scale overflows to inf/nan instead. The dynamic scaler follows Megatron's rules:

* an overflow skips the step, zeroes the clean-step counter and decrements a hysteresis
  counter; once that counter is <= 0, *every* overflow multiplies the scale by
  ``backoff_factor`` (floored at ``min_scale``). The counter is refilled only by growth, so
  overflows need not be consecutive to exhaust it;
* ``growth_interval`` consecutive clean steps multiply the scale by ``growth_factor`` and
  refill the hysteresis counter.

bf16 and fp32 need no scaling: ``ConstantLossScaler(1.0)`` keeps the same interface, so the
trainer has one code path. Both count skipped steps, since a non-finite gradient skips the
update whatever the precision.

Every rank must skip together, or replicas diverge: ``found_inf_across_ranks`` does one fused
local check (optionally unscaling in the same pass) and an all-reduce MAX of the flag.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from ..config.errors import ConfigError, Problem
from ..config.schema import OptimizerConfig
from ..parallel.device import cuda
from ..parallel.strict import served_devices


class LossScaler:
    """What the trainer needs from any scaler: the scale, its inverse, update and (re)store."""

    def __init__(self, scale: float):
        self._scale = float(scale)
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def inv_scale(self) -> float:
        return 1.0 / self._scale

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.skipped_steps += 1

    def state_dict(self) -> dict:
        return {"scale": self._scale, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = int(_entry(state, "skipped_steps", type(self).__name__))


class ConstantLossScaler(LossScaler):
    """A fixed scale; 1.0 (bf16/fp32) makes scaling a no-op. The scale comes from the config, not the checkpoint."""

    def __init__(self, scale: float = 1.0):
        if not scale > 0:
            raise ConfigError("ConstantLossScaler.scale", scale, "must be > 0", "use 1.0 for bf16/fp32")
        super().__init__(scale)


class DynamicLossScaler(LossScaler):
    """Megatron's dynamic scale: back off after ``hysteresis`` overflows, grow after a clean window."""

    def __init__(self, initial_scale: float, growth_interval: int, backoff_factor: float, hysteresis: int,
                 min_scale: float, growth_factor: float = 2.0):
        checks = [
            (initial_scale > 0, "optimizer.initial_loss_scale", initial_scale, "must be > 0", "use e.g. 65536"),
            (0 < min_scale <= initial_scale, "optimizer.min_loss_scale", min_scale,
             f"must be in (0, initial_loss_scale={initial_scale}]", "use e.g. 1.0"),
            (0 < backoff_factor < 1, "optimizer.loss_scale_backoff", backoff_factor, "must be in (0, 1)",
             "use e.g. 0.5"),
            (growth_factor > 1, "growth_factor", growth_factor, "must be > 1", "use e.g. 2.0"),
            (growth_interval >= 1, "optimizer.loss_scale_window", growth_interval, "must be >= 1",
             "use e.g. 1000"),
            (hysteresis >= 1, "optimizer.hysteresis", hysteresis, "must be >= 1",
             "use 1 to back off on every overflow, or e.g. 2"),
        ]
        problems = [Problem(key, value, rule, fix) for ok, key, value, rule, fix in checks if not ok]
        if problems:
            raise ConfigError.of(problems)
        super().__init__(initial_scale)
        self.growth_interval = int(growth_interval)
        self.backoff_factor = float(backoff_factor)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        super().update(found_inf)
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self._scale *= self.growth_factor

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["growth_tracker"] = self.growth_tracker
        state["hysteresis_tracker"] = self.hysteresis_tracker
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume the scale and both counters; the factors and intervals stay as configured."""
        super().load_state_dict(state)
        name = type(self).__name__
        scale = float(_entry(state, "scale", name))
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"{name}.load_state_dict: scale={scale!r} must be finite and > 0; the checkpoint is "
                             f"corrupt. Fix: load another checkpoint.")
        self._scale = scale
        self.growth_tracker = int(_entry(state, "growth_tracker", name))
        self.hysteresis_tracker = int(_entry(state, "hysteresis_tracker", name))


def loss_scaler_from_config(opt: OptimizerConfig, fp16: bool) -> LossScaler:
    """fp16 gets the dynamic scaler from the optimizer section; bf16/fp32 get the no-op scale 1."""
    if not fp16:
        return ConstantLossScaler(1.0)
    return DynamicLossScaler(opt.initial_loss_scale, opt.loss_scale_window, opt.loss_scale_backoff,
                             opt.hysteresis, opt.min_loss_scale)


def found_inf_across_ranks(grads: Iterable[Optional[torch.Tensor]], group=None, inv_scale: float = 1.0) -> bool:
    """True when any rank of ``group`` holds a non-finite gradient; multiplies grads by ``inv_scale`` on the way.

    The local check is torch's fused non-finite-check-and-unscale kernel (one pass per device
    and dtype), so fp16 unscaling costs no extra pass. ``None`` entries (parameters without a
    gradient) are skipped. Every rank of ``group`` must call this, even with no gradients.
    """
    flags = []
    for (device, _), tensors in _by_device_and_dtype(g for g in grads if g is not None).items():
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(
            tensors, flag, torch.full((1,), inv_scale, dtype=torch.float32, device=device))
        flags.append(flag)
    distributed = dist.is_available() and dist.is_initialized()
    device = _flag_device(flags, group, distributed)
    found = torch.zeros(1, dtype=torch.float32, device=device)
    for flag in flags:
        found = torch.maximum(found, flag.to(device))
    if distributed:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item() > 0)


def _by_device_and_dtype(tensors: Iterable[torch.Tensor]) -> dict:
    """The fused kernel takes one device (and runs fastest on one dtype) per call."""
    groups: dict = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return groups


def _flag_device(flags: list, group, distributed: bool) -> torch.device:
    """Where the flag must live for the all-reduce: beside the gradients where the group serves their device
    (NCCL: the current GPU), else the host (gloo); a rank without gradients picks as the others do."""
    if not distributed:
        return flags[0].device if flags else torch.device("cpu")
    served = served_devices(group if group is not None else dist.group.WORLD)
    if flags and flags[0].device.type in served:
        return flags[0].device
    return torch.device("cpu") if "cpu" in served else torch.device("cuda", cuda.current_device())


def _entry(state: dict, key: str, owner: str):
    if key not in state:
        raise KeyError(f"{owner}.load_state_dict: the checkpoint has no {key!r} entry (it has {sorted(state)}). "
                       f"Fix: load a checkpoint saved by {owner}.state_dict().")
    return state[key]



__all__ = ["LossScaler", "ConstantLossScaler", "DynamicLossScaler", "loss_scaler_from_config",
           "found_inf_across_ranks"]
