"""What checkpoints, accounting and the rehearsal read of a ``DistributedOptimizer``'s state, and how a load puts it
back: the fragments this rank steps with their masters and state tensors by name (Adam's moments, SGD's or Muon's
momentum, a bf16 master's compensation), each in its own dtype; the scalars; the bytes held where. A mixin of the
optimizer, so that its step and its state's bookkeeping stay in files of their own."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .buckets import Fragment
from .muon import MOMENTUM
from .param_groups import InnerSteps


@dataclass(frozen=True)
class OwnedFragment:
    """What a checkpoint keeps of one fragment this rank steps (``owned_fragments``)."""

    fragment: Fragment
    name: str  # the parameter's stored name: its global name, or its original's for a tied copy
    info: object  # the parameter's sharding-table row (``tensor_parallel.ParamInfo``)
    master: torch.Tensor  # the master of the fragment (flat; fp32, or the bf16 weight itself)
    states: dict  # the inner optimizer's state tensors for it by name (none before the first step)
    keys: tuple[str, ...]  # the names of the state tensors it has once stepped


class StateAccess:
    """The state side of ``DistributedOptimizer`` (see the module docstring)."""

    def owned_fragments(self) -> list[OwnedFragment]:
        self.host.settle()
        states = {m: state for inner in self._inner() for m, state in inner.states().items()}
        return [OwnedFragment(f, self.infos[id(f.param)].tied_to or self.names[id(f.param)], self.infos[id(f.param)],
                              m, {**states.get(m, {}), **self._muon_state(i)}, self.state_keys_of(i))
                for i, (f, m) in enumerate(zip(self.fragments, self.masters))]

    def _inner(self) -> list[InnerSteps]:
        """The inner optimizers: the device's, and the host's for offloaded masters (either may be absent)."""
        return [inner for inner in (self.optimizer, self.host.optimizer) if inner is not None]

    def _muon_state(self, index: int) -> dict:
        return self.muon.state_of(index) if self.muon is not None else {}

    def _inner_of(self, index: int) -> InnerSteps:
        return self.host.optimizer if index in self.host.masters else self.optimizer

    def state_keys_of(self, index: int) -> tuple[str, ...]:
        """Fragment ``index``'s per-element state tensors: Adam's moments, SGD's or Muon's momentum, a bf16
        master's compensation."""
        muon = (MOMENTUM,) if self.muon is not None and self.muon.scale_of(index) is not None else ()
        return muon + self._inner_of(index).keys(self.masters[index])

    def new_state(self, index: int, key: str) -> torch.Tensor:
        """An empty tensor of the dtype and place fragment ``index``'s state ``key`` takes (a load reads into it)."""
        if key == MOMENTUM:
            return self.muon.new_state(index)
        return self._inner_of(index).new_state(self.masters[index], key)

    def scalars(self) -> dict:
        """The optimizer's scalars, the same on every rank: the loss scaler's state and the step count."""
        return {"scaler": self.scaler.state_dict(), "step": self.steps}

    def load(self, states: list[dict], scalars: dict) -> None:
        """Take loaded state tensors (per owned fragment, in ``owned_fragments`` order) and ``scalars``. A state
        left out starts afresh (an AdamW checkpoint holds no Muon momentum; Adam's moments restart at step 0)."""
        self.host.settle()
        step = int(scalars["step"])
        by_master = {id(m): {k: v for k, v in entry.items() if k != MOMENTUM} for m, entry in zip(self.masters, states)}
        for inner in self._inner():
            inner.load(by_master, step)
        if self.muon is not None:
            self.muon.load({i: entry[MOMENTUM] for i, entry in enumerate(states) if MOMENTUM in entry})
        self.scaler.load_state_dict(scalars["scaler"])
        self.steps = step
        if self.units is not None:  # the weights were loaded too: no gathered copy of the old ones survives
            self.units.release_all()

    def device_state(self) -> list[torch.Tensor]:
        """The optimizer state tensors held on the device (not the host's): moments, momenta, compensations."""
        states = list(self.optimizer.states().values()) if self.optimizer is not None else []
        held = [t for state in states for t in state.values() if torch.is_tensor(t)]
        return held + (list(self.muon.momentum.values()) if self.muon is not None else [])

    # ----- accounting ------------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Bytes held on this rank: ``master_bytes`` even where masters are the fp32 weights; ``params``, weight
        elements; ``host_bytes``, masters and optimizer state offloaded (``optimizer.offload``); ``weight_bytes``,
        weights held now (ZeRO-3: shard + gathered layers); ``gathered_peak_bytes``, ZeRO-3's most gathered."""
        states = [state for inner in self._inner() for state in inner.states().values()]
        states += [{MOMENTUM: m} for m in (self.muon.momentum.values() if self.muon is not None else [])]
        return {
            "params": sum(p.numel() for buffer in self.buffers for p in buffer.params),
            "master_bytes": sum(m.numel() * m.element_size() for m in self.masters),
            "optimizer_state_bytes": sum(t.numel() * t.element_size() for state in states
                                         for t in state.values() if torch.is_tensor(t)),
            "grad_bytes": sum(buffer.grad_bytes() for buffer in self.buffers),
            "grad_peak_bytes": sum(buffer.peak_grad_bytes() for buffer in self.buffers),
            "host_bytes": self.host.host_bytes(),
            "weight_bytes": sum(buffer.weights.resident_bytes() for buffer in self.buffers),
            "gathered_peak_bytes": self.units.peak_bytes if self.units is not None else 0,
        }
