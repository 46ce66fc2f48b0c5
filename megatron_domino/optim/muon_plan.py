"""Who orthogonalizes which matrix, and which elements travel where: Muon's plan, fixed when the optimizer is built.

Muon's momentum is elementwise, so it lives in ZeRO's flat shards like Adam's moments (balanced by bytes to the
element, checkpointed and offloaded the same way). Only Newton-Schulz needs a matrix whole, so only its input
travels: each Muon weight of a stage has one owner (a TP rank, a DP rank) among the ranks holding pieces of it,
and the owner gathers the weight's update from its ZeRO shards (over the DP group) and its TP pieces (over the TP
group), orthogonalizes every logical matrix in it once, and sends each piece back.

The owners are chosen by longest-processing-time first over Newton-Schulz's FLOPs: the costliest weight goes to
the least-loaded slot. A slot is a (TP rank, DP rank) pair, so the work spreads over both; a weight each TP rank
holds alone (whole experts under expert TP 1) is owned within its TP rank's DP group. Experts are owned inside
their expert-data-parallel group. Every rank computes the same plan from what it knows alike (the parameters'
order and shapes, the bucket layout), so no plan is exchanged.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from ..parallel.comm import group_rank, group_size
from ..tensor_parallel.sharding import ParamInfo
from .muon_math import matrix_rows, ns_flops, scale, shapes


@dataclass
class MuonWeight:
    """One Muon weight of this rank's chunks, as every rank of its domain knows it."""

    param: torch.Tensor
    info: ParamInfo
    kind: str  # split (TP pieces) | replicated (the same on every TP rank) | own (this TP rank's alone)
    full_shape: tuple[int, int]
    layout: tuple  # its logical matrices (``muon_math.matrix_rows``)
    ranges: list[tuple[int, int]]  # per DP rank of its group: the TP-local flat elements that rank holds
    sharded: bool  # ZeRO shards it over the DP group (else every DP rank holds it all)
    cost: int  # Newton-Schulz FLOPs of all its matrices
    base_scale: float  # the update's scale of its first matrix: fragments apply it
    relative: list[float]  # each matrix's scale over ``base_scale``: the owner applies it
    owner: tuple[int, int] = (0, 0)  # (TP rank, DP rank)
    round: int = 0  # which of the step's rounds carries it (``muon.ROUNDS``)
    fragment: int | None = None  # index of this rank's fragment of it among the optimizer's fragments

    @property
    def local_numel(self) -> int:
        return self.param.numel()


@dataclass
class Domain:
    """The Muon weights whose shards one DP group holds, and how TP ranks share their ownership."""

    group: object  # the DP group (dp x cp, or the experts' expert-data-parallel group)
    own: bool  # weights each TP rank holds alone: owned in this TP rank's DP group only
    weights: list[MuonWeight] = field(default_factory=list)

    @property
    def dp_rank(self) -> int:
        return group_rank(self.group)


def _ranges(buffer, param) -> list[tuple[int, int]]:
    """Per DP rank of the buffer's group, the elements of ``param``'s TP-local flat it holds."""
    n, size = param.numel(), group_size(buffer.group)
    if buffer.shards == 1:
        return [(0, n)] * size  # no ZeRO sharding: every replica holds all of it
    bucket = buffer.bucket_of[id(param)]
    offset = bucket.offsets[[id(p) for p in bucket.params].index(id(param))]
    clip = lambda at: min(max(at - offset, 0), n)  # noqa: E731
    return [(clip(r * bucket.shard_size), clip((r + 1) * bucket.shard_size)) for r in range(buffer.shards)]


def describe(param, info: ParamInfo, buffer, tp: int, opt) -> MuonWeight:
    """A Muon weight's plan entry (owner and fragment still unset)."""
    full = info.full_shape(param.shape)
    kind = "own" if not info.tp_replicated else "split" if info.spec is not None and tp > 1 else "replicated"
    dim, pieces = matrix_rows(info, full, opt.muon_split_qkv)
    layout = (dim, [p.to(param.device) if torch.is_tensor(p) else p for p in pieces])  # made once, not per step
    dims = shapes(full, layout)
    scales = [scale(rows, cols, opt.muon_scale) for rows, cols in dims]
    return MuonWeight(param, info, kind, full, layout, _ranges(buffer, param), buffer.shards > 1,
                      sum(ns_flops(rows, cols, opt.muon_ns_steps) for rows, cols in dims),
                      scales[0], [s / scales[0] for s in scales])


def assign_owners(costs: list[int], slots: list) -> list:
    """Longest processing time first: each cost, largest first (ties in list order), to the least-loaded slot
    (ties to the earliest). Returns each cost's slot, in the input order."""
    loads = [(0, index) for index in range(len(slots))]
    owners = [None] * len(costs)
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, index = heapq.heappop(loads)
        owners[item] = slots[index]
        heapq.heappush(loads, (load + costs[item], index))
    return owners


def plan_domains(entries: list[tuple], tp_group, tp_rank: int) -> list[Domain]:
    """``entries``: (MuonWeight, its buffer's DP group) in the buffers' order, the same on every rank of a
    domain. Groups them into domains and sets every weight's owner."""
    tp = group_size(tp_group)
    domains: dict[tuple, Domain] = {}
    for weight, group in entries:
        own = weight.kind == "own"
        domains.setdefault((id(group), own), Domain(group, own)).weights.append(weight)
    for domain in domains.values():
        dp = group_size(domain.group)
        slots = [(tp_rank, d) for d in range(dp)] if domain.own else [(t, d) for t in range(tp) for d in range(dp)]
        for weight, owner in zip(domain.weights, assign_owners([w.cost for w in domain.weights], slots)):
            weight.owner = owner
    return list(domains.values())


def owner_loads(domains: list[Domain], tp: int) -> dict[tuple[int, int], int]:
    """Newton-Schulz FLOPs per (TP rank, DP rank) slot of these domains (the balance a test and the planner read)."""
    loads: dict[tuple[int, int], int] = {}
    for domain in domains:
        for weight in domain.weights:
            loads[weight.owner] = loads.get(weight.owner, 0) + weight.cost
    return loads
