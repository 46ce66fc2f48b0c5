"""Checkpoint state of the sharded optimizer, as rectangles of layout-free full tensors.

Each rank offers exactly what it steps: for every fragment of a parameter it owns (a flat range of the
TP-local parameter, ``grad_buffer.Fragment``), the fp32 master and the optimizer's states, placed in the
full tensor '<param>/<state>' by ``tensor_parallel.regions``. Nothing is gathered: a save writes these
views, a load reads into them. Since the full tensors depend on neither the DP size, the ZeRO stage
nor the bucket size, a run saved at dp = 2 / ZeRO-1 resumes at dp = 4 / ZeRO-2: each rank reads the
rectangles of its new fragments. A tied copy of a parameter (the last stage's output head) is stored
once, by its original, and read from it. Only what the optimizer exposes for checkpoints is used
(``owned_fragments``, ``new_state``, ``scalars``, ``load``): its buffers and inner optimizer stay its own.
"""
from __future__ import annotations

import torch

from ..tensor_parallel.regions import Region, regions, stored_shape


def _regions(dopt, owned, flat: torch.Tensor) -> list[Region]:
    fragment = owned.fragment
    return regions(fragment.param, owned.info, dopt.tp_rank, fragment.start, fragment.end, flat=flat)


def checkpoint_regions(dopt) -> dict[str, tuple[tuple[int, ...], torch.dtype, list[Region]]]:
    """'<param>/<state>' -> (full shape, dtype, this rank's regions): what this rank writes, each state in its own
    dtype (bf16 moments stay 2 bytes). Before the first step the optimizer has no states yet, and only masters are
    offered."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype, list[Region]]] = {}
    for owned in dopt.owned_fragments():
        if owned.info.tied_to is not None:  # stored once, by its original
            continue
        for key in ("master",) + owned.keys:
            value = owned.master if key == "master" else owned.states.get(key)
            if value is None:
                continue
            shape = stored_shape(owned.fragment.param.shape, owned.info)
            entry = out.setdefault(f"{owned.name}/{key}", (shape, value.dtype, []))
            entry[2].extend(_regions(dopt, owned, value.detach()))
    return out


def sharded_weight_fragments(dopt) -> dict[int, list]:
    """ZeRO-3: id of every weight that exists only as shards -> this rank's fragments of it (none where other
    ranks hold all of it): a checkpoint reads and writes the model's weights there, in the shard."""
    found = {id(p): [] for buffer in dopt.buffers if buffer.weights.sharded for p in buffer.params}
    for fragment in dopt.fragments:
        if id(fragment.param) in found:
            found[id(fragment.param)].append(fragment)
    return found


def checkpoint_meta(dopt) -> dict:
    """The optimizer's scalars, the same on every rank: they go into the checkpoint's metadata."""
    return dopt.scalars()


class ShardedStateLoad:
    """Where a load puts the optimizer state: masters straight into their tensors, optimizer states into fresh
    per-fragment buffers that ``apply`` hands to the optimizer (which places them on its device). ``stored``: the
    '<param>/<state>' names the checkpoint holds; a state it lacks (the momentum of Muon in a checkpoint trained
    with AdamW, Adam's moments in one trained with Muon) starts afresh, and ``fresh`` names it for the log."""

    def __init__(self, dopt, meta: dict, stored: set[str] | None = None):
        self.dopt, self.meta = dopt, meta
        self.owned = dopt.owned_fragments()
        self.fresh: set[str] = set()
        self.states = []
        for index, owned in enumerate(self.owned):
            keys = owned.keys if int(meta["step"]) > 0 else ()
            found = [k for k in keys if stored is None or f"{owned.name}/{k}" in stored]
            self.fresh.update(k for k in keys if k not in found)
            self.states.append({key: dopt.new_state(index, key) for key in found})

    def targets(self) -> dict[str, list[Region]]:
        """'<param>/<state>' -> the regions this rank reads."""
        wanted: dict[str, list[Region]] = {}
        for owned, states in zip(self.owned, self.states):
            for key, flat in (("master", owned.master), *states.items()):
                wanted.setdefault(f"{owned.name}/{key}", []).extend(_regions(self.dopt, owned, flat))
        return wanted

    @torch.no_grad()
    def apply(self) -> None:
        self.dopt.load(self.states, self.meta)
