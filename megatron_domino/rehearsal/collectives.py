"""Collectives and transfers a rehearsed rank issues, per process group: how many, and how many bytes.

Counted where torch dispatches them (``c10d`` ops), so nothing the library or torch issues is missed.
A group is named by its role in the parallel state (``tp``, ``dp``, ``pp``, ...); point-to-point
transfers, which go over the world group, are named by their peer: ``pp`` for the next or previous
pipeline stage, ``cp`` for a context-parallel ring neighbour. An op's bytes are its largest buffer on
this rank (the all-reduced tensor, the all-gather's output, the reduce-scatter's input, a transfer's
tensor).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .shadows import tensors_in

# ParallelState's group attributes, most specific first: a group serving two roles takes the first name
GROUP_ROLES = ("tp", "cp", "pp", "dp", "dp_cp", "ep", "expert_dp", "expert", "embedding", "mp")


def _bytes(value) -> int:
    return max((t.numel() * t.element_size() for t in tensors_in(value)), default=0)


class CollectiveCounter:
    def __init__(self):
        self.names: dict[str, str] = {}  # process group name -> role
        self.pp_peers: set[int] = set()
        self.cp_peers: set[int] = set()
        self.counts: dict[str, dict[str, int]] = {}
        self.counting = False

    def name_groups(self, state) -> None:
        """Learn the roles of ``state``'s groups (a ``parallel.state.ParallelState``)."""
        for role in GROUP_ROLES:
            group = getattr(state, f"{role}_group", None)
            if group is not None and group.group_name not in self.names:
                self.names[group.group_name] = role
        self.pp_peers = {state.next_pp_rank, state.prev_pp_rank} - {state.rank}
        self.cp_peers = set(state.cp_ranks) - {state.rank}
        self.names.setdefault(dist.group.WORLD.group_name, "world")

    def count(self, func, args) -> None:
        if not self.counting:
            return
        group = next(a for a in args if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()))
        pg = torch._C._distributed_c10d.ProcessGroup.unbox(group)
        role = self.names.get(pg.group_name, pg.group_name)
        if func in (torch.ops.c10d.send.default, torch.ops.c10d.recv_.default) and role == "world":
            peer = args[2]
            role = "pp" if peer in self.pp_peers else "cp" if peer in self.cp_peers else "world"
        entry = self.counts.setdefault(role, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += max(_bytes(args[0]), _bytes(args[1]) if len(args) > 1 else 0)
