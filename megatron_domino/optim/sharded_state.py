"""Checkpoint state of the sharded optimizer, as rectangles of layout-free full tensors.

Each rank offers exactly what it steps: for every fragment of a parameter it owns (a flat range of the
TP-local parameter, ``grad_buffer.Fragment``), the fp32 master and the optimizer's states, placed in the
full tensor '<param>/<state>' by ``tensor_parallel.regions``. Nothing is gathered: a save writes these
views, a load reads into them. Since the full tensors depend on neither the DP size, the ZeRO stage
nor the bucket size, a run saved at dp = 2 / ZeRO-1 resumes at dp = 4 / ZeRO-2: each rank reads the
rectangles of its new fragments. A tied copy of a parameter (the last stage's output head) is stored
once, by its original, and read from it.
"""
from __future__ import annotations

import torch

from ..tensor_parallel.regions import Region, regions, stored_shape
from .param_groups import STATE_KEYS, uses_apex


def _fragment_regions(dopt, fragment, flat: torch.Tensor) -> list[Region]:
    return regions(fragment.param, dopt.infos[id(fragment.param)], dopt.tp_rank, fragment.start, fragment.end,
                   flat=flat)


def _stored_name(dopt, param) -> str:
    info = dopt.infos[id(param)]
    return info.tied_to or dopt.names[id(param)]


def checkpoint_regions(dopt) -> dict[str, tuple[tuple[int, ...], list[Region]]]:
    """'<param>/<state>' -> (full shape, this rank's regions): what this rank writes. Before the first step
    the optimizer has no states yet, and only masters are offered."""
    keys = ("master",) + STATE_KEYS[dopt.opt.name]
    states = dopt.optimizer.state if dopt.optimizer is not None else {}
    out: dict[str, tuple[tuple[int, ...], list[Region]]] = {}
    for fragment, master in zip(dopt.fragments, dopt.masters):
        info = dopt.infos[id(fragment.param)]
        if info.tied_to is not None:
            continue
        for key in keys:
            value = master if key == "master" else states.get(master, {}).get(key)
            if value is None:
                continue
            name = f"{dopt.names[id(fragment.param)]}/{key}"
            shape = stored_shape(fragment.param.shape, info)
            out.setdefault(name, (shape, []))[1].extend(_fragment_regions(dopt, fragment, value.detach()))
    return out


def checkpoint_meta(dopt) -> dict:
    """The optimizer's scalars, the same on every rank: they go into the checkpoint's metadata."""
    return {"scaler": dopt.scaler.state_dict(), "step": dopt.steps}


class ShardedStateLoad:
    """Where a load puts the optimizer state: masters straight into their tensors, optimizer states into
    fresh per-fragment buffers that ``apply`` hands to the inner optimizer (which places them on its device)."""

    def __init__(self, dopt, meta: dict):
        self.dopt, self.meta = dopt, meta
        self.step = int(meta["step"])
        keys = STATE_KEYS[dopt.opt.name] if dopt.optimizer is not None and self.step > 0 else ()
        self.states = [{key: torch.zeros_like(master) for key in keys} for master in dopt.masters]

    def targets(self) -> dict[str, list[Region]]:
        """'<param>/<state>' -> the regions this rank reads."""
        wanted: dict[str, list[Region]] = {}
        for fragment, master, states in zip(self.dopt.fragments, self.dopt.masters, self.states):
            stored = _stored_name(self.dopt, fragment.param)
            for key, flat in (("master", master), *states.items()):
                wanted.setdefault(f"{stored}/{key}", []).extend(_fragment_regions(self.dopt, fragment, flat))
        return wanted

    @torch.no_grad()
    def apply(self) -> None:
        dopt = self.dopt
        if any(self.states):
            self._load_optimizer_states()
        dopt.scaler.load_state_dict(self.meta["scaler"])
        dopt.steps = self.step

    def _load_optimizer_states(self) -> None:
        dopt = self.dopt
        index_of = {id(m): i for i, m in enumerate(dopt.masters)}
        packed = dopt.optimizer.state_dict()
        per_index, index = {}, 0
        for group in dopt.optimizer.param_groups:
            for master in group["params"]:
                entry = dict(self.states[index_of[id(master)]])
                if dopt.opt.name == "adamw":
                    entry["step"] = torch.tensor(float(self.step))
                per_index[index] = entry
                index += 1
        packed["state"] = per_index
        if uses_apex(dopt.opt, dopt.device):  # apex counts steps per group, not per tensor
            for group in packed["param_groups"]:
                group["step"] = self.step
        dopt.optimizer.load_state_dict(packed)
