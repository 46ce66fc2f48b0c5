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


def group_roles(state) -> dict[str, str]:
    """Process group name -> its role in ``state`` (a ``parallel.state.ParallelState``); the world is "world"."""
    names = {}
    for role in GROUP_ROLES:
        group = getattr(state, f"{role}_group", None)
        if group is not None:
            names.setdefault(group.group_name, role)
    names.setdefault(dist.group.WORLD.group_name, "world")
    return names


def peers(state) -> tuple[set[int], set[int]]:
    """(pipeline neighbours, context-parallel ring members) of this rank: what its transfers are for."""
    return {state.next_pp_rank, state.prev_pp_rank} - {state.rank}, set(state.cp_ranks) - {state.rank}


def peer_role(peer: int, pp_peers: set[int], cp_peers: set[int]) -> str:
    return "pp" if peer in pp_peers else "cp" if peer in cp_peers else "world"


class CollectiveCounter:
    def __init__(self):
        self.names: dict[str, str] = {}  # process group name -> role
        self.pp_peers: set[int] = set()
        self.cp_peers: set[int] = set()
        self.counts: dict[str, dict[str, int]] = {}
        self.counting = False

    def name_groups(self, state) -> None:
        """Learn the roles of ``state``'s groups (a ``parallel.state.ParallelState``)."""
        self.names.update({k: v for k, v in group_roles(state).items() if k not in self.names})
        self.pp_peers, self.cp_peers = peers(state)

    def count(self, func, args) -> None:
        if not self.counting:
            return
        group = next(a for a in args if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()))
        pg = torch._C._distributed_c10d.ProcessGroup.unbox(group)
        role = self.names.get(pg.group_name, pg.group_name)
        if func in (torch.ops.c10d.send.default, torch.ops.c10d.recv_.default) and role == "world":
            role = peer_role(args[2], self.pp_peers, self.cp_peers)
        entry = self.counts.setdefault(role, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += max(_bytes(args[0]), _bytes(args[1]) if len(args) > 1 else 0)
