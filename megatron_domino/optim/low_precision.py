"""Optimizer state below fp32: bf16 moments, and bf16 masters that take updates without losing them.

``optimizer.moments_dtype: bf16`` keeps Adam's two moments (and Muon's momentum) in bf16, 2 bytes each instead
of 4: they are read into fp32, updated there and rounded to nearest (Megatron's precision-aware optimizer).

``optimizer.master_dtype: bf16`` makes the bf16 weights their own masters (no 4-byte fp32 copy). An update much
smaller than a weight's last bf16 bit would then round away every step; ``master_rounding`` says how it survives:
- ``stochastic``: rounded up or down at random, with the probability of the distance (16 random bits added to
  the fp32 value's low half, which is then cut), so the expected weight is the exact one; no extra state. The
  bits are a hash of (step, parameter, element), so that copies of an element (TP ranks, the tied embedding's
  stages, ZeRO-0 replicas), a resumed run, another ZeRO layout and the host's step under offload draw the same;
- ``compensated``: a bf16 compensation per weight keeps what rounding lost (Kahan's sum), added back before the
  next update: weight + compensation carries about 16 significant bits, for 2 more bytes per weight.

Both take their masters' gradients (updates) in ``inputs``, not ``.grad``, whose dtype must be the master's.
``LowPrecisionAdamW`` is torch's AdamW (decoupled decay, bias-corrected moments) in that arithmetic; with fp32
state it computes what torch's single-tensor AdamW does. ``MuonApply`` is Muon's last line, the decay and the
orthogonalized update of a master (``optim/muon.py`` computes the update).
"""
from __future__ import annotations

import zlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def stream_key(name: str, start: int) -> tuple[int, int]:
    """The random stream of the fragment of parameter ``name`` (its stored name: a tied copy takes its original's)
    that begins at element ``start``: the same on every rank holding that fragment (TP copies, ZeRO-0 replicas,
    the tied embedding's two stages), so that copies round alike and stay equal."""
    return zlib.crc32(name.encode()), start


_MASK = 0xFFFFFFFF
CHUNK = 1 << 22  # elements hashed at once (an int64 index each)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values below 2^32 (Chris Wellons' lowbias32 family), without overflow."""
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK
    return (x >> 16) ^ x


def stochastic_round(value: torch.Tensor, key: tuple[int, int], step: int) -> torch.Tensor:
    """fp32 ``value`` to bf16, up or down at random with the probability of the distance to each. The 16 random
    bits of element i are a hash of (the parameter, its element ``key[1] + i``, ``step``): counter-based, so no
    generator state exists to save, and every copy of an element draws the same bits on any device or layout."""
    seed = zlib.crc32(f"{key[0]}:{step}".encode())
    out = torch.empty(value.shape, dtype=torch.bfloat16, device=value.device)
    flat, target = value.reshape(-1), out.view(-1)
    for lo in range(0, flat.numel(), CHUNK):
        hi = min(lo + CHUNK, flat.numel())
        index = torch.arange(key[1] + lo, key[1] + hi, dtype=torch.int64, device=value.device)
        noise = (_hash32((index ^ seed) & _MASK) & 0xFFFF).to(torch.int32)
        target[lo:hi] = ((flat[lo:hi].view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)
    return out


class _Masters(torch.optim.Optimizer):
    """What both rules share: reading a master into fp32 (plus its compensation), writing it back rounded."""

    def __init__(self, params, defaults: dict, rounding: str):
        super().__init__(params, defaults)
        self.rounding = rounding
        self.inputs: dict[int, torch.Tensor] = {}  # id(master) -> its gradient or update, set before each step
        self.keys: dict[int, tuple] = {}  # id(master) -> its random stream (``stream_key``)

    def _compensated(self, master: torch.Tensor) -> bool:
        return master.dtype == torch.bfloat16 and self.rounding == "compensated"

    def _begin(self, master: torch.Tensor, state: dict) -> torch.Tensor:
        """The master's value in fp32: the master itself when it is fp32 (updated in place)."""
        if master.dtype == torch.float32:
            return master
        if self._compensated(master):
            if "master_compensation" not in state:
                state["master_compensation"] = torch.zeros_like(master)
            return master.float().add_(state["master_compensation"])
        return master.float()

    def _end(self, master: torch.Tensor, value: torch.Tensor, state: dict, step: int) -> None:
        if value is master:
            return
        if self._compensated(master):
            master.copy_(value)
            state["master_compensation"].copy_(value - master.float())
            return
        master.copy_(stochastic_round(value, self.keys.get(id(master), (0, 0)), step))


class LowPrecisionAdamW(_Masters):
    """AdamW with ``moments_dtype`` moments and masters in their own dtype (see the module docstring)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, moments_dtype: torch.dtype,
                 rounding: str):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0}, rounding)
        self.moments_dtype = moments_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd, eps, (beta1, beta2) = group["lr"], group["weight_decay"], group["eps"], group["betas"]
            for master in group["params"]:
                grad = self.inputs.get(id(master))
                if grad is None:
                    continue
                state = self.state[master]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(master, dtype=self.moments_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(master, dtype=self.moments_dtype)
                state["step"] += 1
                step = int(state["step"].item())  # a host tensor: no device sync
                grad = grad.float()
                exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                value = self._begin(master, state)
                value.mul_(1 - lr * wd)
                denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
                value.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))
                self._end(master, value, state, step)
                if state["exp_avg"] is not exp_avg:
                    state["exp_avg"].copy_(exp_avg)
                    state["exp_avg_sq"].copy_(exp_avg_sq)


class MuonApply(_Masters):
    """master <- master (1 - lr wd) - lr s O, with O (its ``inputs``) the orthogonalized update of its matrix and
    s its scale (``scales``: id(master) -> s); torch.optim.Muon's last two lines."""

    def __init__(self, params, lr: float, scales: dict[int, float], rounding: str):
        super().__init__(params, {"lr": lr, "weight_decay": 0.0}, rounding)
        self.scales = scales
        self.number = 1  # the optimizer step being taken (the stochastic rounding's stream): its caller sets it

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for master in group["params"]:
                update = self.inputs.get(id(master))
                if update is None:
                    continue
                state = self.state[master]
                value = self._begin(master, state)
                value.mul_(1 - lr * wd)
                value.add_(update, alpha=-lr * self.scales[id(master)])
                self._end(master, value, state, self.number)
