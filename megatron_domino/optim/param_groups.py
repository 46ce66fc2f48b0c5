"""The inner optimizers that update this rank's shard of masters: which tensors decay, which rule and kernel runs.

Weight decay shrinks weights toward zero; on biases and norm gains (1-D parameters) that only removes useful
offsets and scales, so by default they get none. The decision is made on the model parameter, because a ZeRO
shard of any parameter is a 1-D tensor.

Rules: AdamW (torch's, or ``low_precision.LowPrecisionAdamW`` when a master or the moments are bf16), SGD, and
under ``optimizer.name: muon`` Muon's update of the matrices (``low_precision.MuonApply``; ``optim/muon.py``
computes it) beside AdamW for everything else, with its own lr and decay (``adamw_lr``, ``adamw_weight_decay``).
Kernels: apex's FusedAdam when it is importable and the shard is on CUDA, else torch's fused kernels on CUDA,
else torch's multi-tensor (foreach) path on the CPU (and for masters offloaded to it).
"""
from __future__ import annotations

import torch

from ..config.errors import ConfigError
from ..config.schema import OptimizerConfig
from .low_precision import DTYPES, LowPrecisionAdamW, MuonApply

try:  # optional: NVIDIA apex, never required
    from apex.optimizers import FusedAdam as _ApexFusedAdam
except ImportError:
    _ApexFusedAdam = None

STATE_KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",), "muon": ("muon_momentum",)}
COMPENSATION = "master_compensation"  # bf16 masters with master_rounding: compensated


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


def _adamw(groups: list[dict], opt: OptimizerConfig) -> torch.optim.Optimizer:
    masters = [m for group in groups for m in group["params"]]
    if opt.moments_dtype != "fp32" or any(m.dtype != torch.float32 for m in masters):
        return LowPrecisionAdamW(groups, opt.lr, (opt.beta1, opt.beta2), opt.eps, DTYPES[opt.moments_dtype],
                                 opt.master_rounding)
    devices = master_device_types(groups)
    if uses_apex(opt, devices):
        return _ApexFusedAdam(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, adam_w_mode=True)
    kernel = {"fused": True} if devices == {"cuda"} else {"foreach": True}
    return torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, **kernel)


class InnerSteps:
    """The rules stepping a set of masters. ``masters``: (master, model parameter, Muon's scale of its matrix or
    None, its stochastic rounding's stream: ``low_precision.stream_key``)."""

    def __init__(self, masters: list[tuple[torch.Tensor, torch.Tensor, float | None, int]], opt: OptimizerConfig):
        if opt.name not in STATE_KEYS:
            raise ConfigError("optimizer.name", opt.name, f"must be one of {sorted(STATE_KEYS)}",
                              "use adamw, muon or sgd")
        self.opt, self.optimizers, self.rule = opt, [], {}
        muon = [(m, p, s) for m, p, s, _ in masters if s is not None]
        rest = [(m, p) for m, p, s, _ in masters if s is None]
        if opt.name == "muon":
            if muon:
                group = [{"params": [m for m, _, _ in muon], "weight_decay": opt.weight_decay, "lr_scale": 1.0}]
                self._add(MuonApply(group, opt.lr, {id(m): s for m, _, s in muon}, opt.master_rounding), "muon", muon)
            decay = opt.weight_decay if opt.adamw_weight_decay is None else opt.adamw_weight_decay
            ratio = 1.0 if opt.adamw_lr is None else opt.adamw_lr / opt.lr
            groups = [dict(g, lr_scale=ratio) for g in weight_decay_groups(rest, decay)]
        else:
            groups = [dict(g, lr_scale=1.0) for g in weight_decay_groups(rest, opt.weight_decay)]
        if groups:
            kernel = {"fused": True} if master_device_types(groups) == {"cuda"} else {"foreach": True}
            inner = (torch.optim.SGD(groups, lr=opt.lr, momentum=opt.momentum, **kernel) if opt.name == "sgd"
                     else _adamw(groups, opt))
            self._add(inner, "sgd" if opt.name == "sgd" else "adamw", rest)
        for inner in self.optimizers:
            inner.keys = {id(m): key for m, _, _, key in masters}

    def _add(self, inner, rule: str, masters: list) -> None:
        self.optimizers.append(inner)
        self.rule.update((id(m[0]), rule) for m in masters)

    def step(self, lr: float, inputs: dict[int, torch.Tensor], number: int) -> None:
        """Optimizer step ``number`` (from 1) at ``lr``; ``inputs``: id(master) -> its gradient, or Muon's update (a
        master left out is not stepped)."""
        for inner in self.optimizers:
            for group in inner.param_groups:
                group["lr"] = lr * group["lr_scale"]
            masters = [m for group in inner.param_groups for m in group["params"]]
            if isinstance(inner, (LowPrecisionAdamW, MuonApply)):
                inner.inputs, inner.number = inputs, number
                inner.step()
                inner.inputs = {}
                continue
            for master in masters:
                master.grad = inputs.get(id(master))
            inner.step()
            for master in masters:
                master.grad = None

    def states(self) -> dict:
        """master -> its state tensors by name (none before the first step)."""
        return {m: state for inner in self.optimizers for m, state in inner.state.items()}

    def keys(self, master: torch.Tensor) -> tuple[str, ...]:
        """The names of ``master``'s per-element state tensors (what a checkpoint stores of it)."""
        rule = self.rule[id(master)]
        keys = STATE_KEYS[rule] if rule != "muon" else ()  # Muon's momentum lives with the orthogonalization
        compensated = master.dtype == torch.bfloat16 and self.opt.master_rounding == "compensated"
        return keys + (COMPENSATION,) * compensated

    def new_state(self, master: torch.Tensor, key: str) -> torch.Tensor:
        """An empty tensor to load ``key`` of ``master`` into."""
        dtype = DTYPES[self.opt.moments_dtype] if key in ("exp_avg", "exp_avg_sq") else master.dtype
        return torch.zeros(master.shape, dtype=dtype, device=master.device)

    def load(self, states: dict[int, dict], step: int) -> None:
        """Give the optimizers the loaded state tensors of their masters (``states``: id(master) -> name -> tensor)
        at step ``step``. A master without moments (a checkpoint of another rule) starts them afresh, at step 0."""
        for inner in self.optimizers:
            entries = []
            for master in (m for group in inner.param_groups for m in group["params"]):
                entry = dict(states.get(id(master), {}))
                if self.rule[id(master)] == "adamw" and "exp_avg" in entry:
                    entry["step"] = torch.tensor(float(step))
                entries.append(entry)
            if isinstance(inner, (LowPrecisionAdamW, MuonApply)):  # torch's load would cast bf16 state to the master's
                inner.state.clear()
                for master, entry in zip((m for group in inner.param_groups for m in group["params"]), entries):
                    if entry:
                        inner.state[master] = {k: v if k == "step" else v.to(master.device) for k, v in entry.items()}
                continue
            packed = inner.state_dict()
            packed["state"] = {index: entry for index, entry in enumerate(entries) if entry}
            if uses_apex(self.opt, master_device_types(inner.param_groups)):  # apex counts steps per group
                for group in packed["param_groups"]:
                    group["step"] = step
            inner.load_state_dict(packed)
