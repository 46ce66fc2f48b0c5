"""The inner optimizer that updates this rank's fp32 shard: which tensors decay, and which kernel runs.

Weight decay shrinks weights toward zero; on biases and norm gains (1-D parameters) that only
removes useful offsets and scales, so by default they get none. The decision is made on the model
parameter, because a ZeRO shard of any parameter is a 1-D tensor.

Implementation: apex's FusedAdam when it is importable and the shard is on CUDA, else torch's
fused kernels on CUDA, else torch's multi-tensor (foreach) path on the CPU (and for masters offloaded to it).
"""
from __future__ import annotations

import torch

from ..config.errors import ConfigError
from ..config.schema import OptimizerConfig

try:  # optional: NVIDIA apex, never required
    from apex.optimizers import FusedAdam as _ApexFusedAdam
except ImportError:
    _ApexFusedAdam = None

STATE_KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def decays(param: torch.Tensor) -> bool:
    """Matrices and embeddings decay; biases and norm weights do not."""
    return param.dim() >= 2


def weight_decay_groups(masters: list[tuple[torch.Tensor, torch.Tensor]], weight_decay: float) -> list[dict]:
    """Param groups from (master tensor, model parameter) pairs; empty groups are left out."""
    decay = [master for master, param in masters if decays(param)]
    no_decay = [master for master, param in masters if not decays(param)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def uses_apex(opt: OptimizerConfig, device_types: set[str]) -> bool:
    return opt.name == "adamw" and device_types == {"cuda"} and _ApexFusedAdam is not None


def master_device_types(groups: list[dict]) -> set[str]:
    """Where the masters live: the device, the host (CPU offload), or both (a fraction offloaded)."""
    return {master.device.type for group in groups for master in group["params"]}


def build_inner_optimizer(groups: list[dict], opt: OptimizerConfig) -> torch.optim.Optimizer:
    """Fused kernels when every master is on CUDA; otherwise multi-tensor ones, which group by device."""
    if opt.name not in STATE_KEYS:
        raise ConfigError("optimizer.name", opt.name, f"must be one of {sorted(STATE_KEYS)}", "use adamw or sgd")
    devices = master_device_types(groups)
    kernel = {"fused": True} if devices == {"cuda"} else {"foreach": True}
    if opt.name == "sgd":
        return torch.optim.SGD(groups, lr=opt.lr, momentum=opt.momentum, **kernel)
    if uses_apex(opt, devices):
        return _ApexFusedAdam(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, adam_w_mode=True)
    return torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, **kernel)


def load_inner_state(inner: torch.optim.Optimizer, states: dict[int, dict], step: int, opt: OptimizerConfig) -> None:
    """Give ``inner`` the loaded state tensors of its masters (``states``: id(master) -> name -> tensor) at
    step ``step``; the optimizer moves them to each master's device."""
    packed = inner.state_dict()
    packed["state"] = {}
    for index, master in enumerate(m for group in inner.param_groups for m in group["params"]):
        entry = dict(states[id(master)])
        if opt.name == "adamw":
            entry["step"] = torch.tensor(float(step))
        packed["state"][index] = entry
    if uses_apex(opt, master_device_types(inner.param_groups)):  # apex counts steps per group, not per tensor
        for group in packed["param_groups"]:
            group["step"] = step
    inner.load_state_dict(packed)
