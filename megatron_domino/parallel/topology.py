"""The rank grid: which global rank sits at which (tp, cp, pp, dp) coordinate, and the groups that follow.

A ``Topology`` is plain arithmetic (no processes), so layouts can be checked and printed
on one CPU process for a 1024-GPU job. ``ParallelState`` turns it into torch.distributed
groups once a process group exists.

Rank order: ``parallel.order`` names the axes innermost first; the default ``tp-cp-dp-pp`` (Megatron's)
puts a TP group on neighbouring ranks (one node), then the context-parallel ring, then data parallelism,
with pipeline stages outermost.
Context-parallel ranks hold different parts of the same sequences: they read the same samples (one
data-parallel rank), and their gradients are reduced together with the data-parallel ones (``dp_cp``).

Expert parallelism (Megatron's rule) takes its ranks from data parallelism: ``ep`` divides dp, and the
expert-parallel group is ep consecutive data-parallel ranks (dp // ep equal, same tp, cp and pp). Its
member of index dp % ep holds that share of the experts. Ranks with the same share (dp % ep equal, any cp)
hold replicas of the same experts: the expert-data-parallel group (``expert_dp``, size dp * cp / ep).
With expert TP 1 (``expert_tp``) experts stay whole and the tp ranks of an expert-parallel group share them
out too: tokens travel among tp x ep ranks (``expert_groups``).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from ..config.checks import Checks
from ..config.schema import AXES


@dataclass(frozen=True)
class Coordinate:
    tp: int
    pp: int
    dp: int
    cp: int = 0


def check_topology(c: Checks, world_size: int | None, tp: int = 1, pp: int = 1, dp: int | None = None,
                   virtual_pp: int = 1, order: str = "tp-cp-dp-pp", cp: int = 1, ep: int = 1,
                   expert_tp: int | None = None) -> int | None:
    """The rules of the rank grid, for ``Topology`` and ``validate_config`` alike: positive sizes,
    tp * cp * pp * dp = the world (when known), ep inside dp, expert TP 1 or tp, a full axis order.
    Returns dp, inferred from the world when unset (None when unknown or broken)."""
    sizes_ok = all([c.positive("parallel.tp", tp), c.positive("parallel.pp", pp), c.positive("parallel.cp", cp),
                    c.positive("parallel.dp", dp, optional=True), c.positive("parallel.virtual_pp", virtual_pp),
                    c.positive("parallel.ep", ep)])
    if sorted(order.split("-")) != sorted(AXES):
        c.fail("parallel.order", order, "must be a permutation of tp, cp, dp, pp joined by '-'",
               "use 'tp-cp-dp-pp' (TP innermost, Megatron's default)")
    if expert_tp not in (None, 1, tp):
        c.fail("parallel.expert_tp", expert_tp, f"must be 1 or parallel.tp = {tp}",
               "leave it unset (experts split over TP like the MLP) or set 1 (whole experts shared out over tp x ep "
               "ranks)")
    if not sizes_ok or world_size is None:
        return dp if sizes_ok else None
    model = tp * cp * pp
    if dp is None and world_size % model:
        c.fail("parallel.dp", None, f"null infers world_size / (tp * cp * pp), but world size {world_size} is not "
               f"divisible by tp * cp * pp = {model}", f"launch a multiple of {model} processes or change tp/cp/pp")
        return None
    if dp is None:
        dp = world_size // model
    elif model * dp != world_size:
        fix = (f"set parallel.dp={world_size // model} or null" if world_size % model == 0
               else f"launch {model * dp} processes")
        c.fail("parallel.dp", dp, f"tp * cp * pp * dp = {model * dp} must equal the world size {world_size}", fix)
        return None
    if dp % ep:
        c.fail("parallel.ep", ep, f"must divide the data-parallel size {dp} (expert ranks are data-parallel ranks)",
               "choose an ep that divides dp")
    return dp


class Topology:
    """World size cut into tp x cp x pp x dp; ``order`` names the axes innermost first ("tp-cp-dp-pp")."""

    def __init__(self, world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None,
                 virtual_pp: int = 1, order: str = "tp-cp-dp-pp", cp: int = 1, ep: int = 1,
                 expert_tp: int | None = None, cp_a2a: int = 1):
        c = Checks()
        dp = check_topology(c, world_size, tp, pp, dp, virtual_pp, order, cp, ep, expert_tp)
        c.raise_problems()
        self.expert_tp = tp if expert_tp is None else expert_tp
        axes = order.split("-")
        self.world_size, self.tp, self.cp, self.pp, self.dp, self.ep = world_size, tp, cp, pp, dp, ep
        self.virtual_pp, self.order = virtual_pp, "-".join(axes)
        self.cp_a2a = cp_a2a  # a2a+ring: consecutive CP ranks in one all-to-all group; 1: no nesting
        self.sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
        self._strides = {}
        stride = 1
        for axis in axes:
            self._strides[axis] = stride
            stride *= self.sizes[axis]

    @classmethod
    def from_config(cls, par, world_size: int) -> "Topology":
        """The topology a ``ParallelConfig`` asks for on ``world_size`` ranks."""
        nested = getattr(par, "cp_comm", "ring") == "a2a+ring"
        return cls(world_size, par.tp, par.pp, par.dp, par.virtual_pp, par.order, cp=par.cp, ep=par.ep,
                   expert_tp=par.expert_tp, cp_a2a=par.cp_a2a_size if nested else 1)

    def rank_of(self, tp: int = 0, pp: int = 0, dp: int = 0, cp: int = 0) -> int:
        """Global rank at a coordinate."""
        coordinate = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
        for axis, value in coordinate.items():
            if not 0 <= value < self.sizes[axis]:
                raise ValueError(f"{axis} coordinate {value} outside 0..{self.sizes[axis] - 1}")
        return sum(coordinate[a] * self._strides[a] for a in AXES)

    def coordinate(self, rank: int) -> Coordinate:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")
        return Coordinate(**{a: (rank // self._strides[a]) % self.sizes[a] for a in AXES})

    def describe(self, rank: int) -> str:
        """'rank 5 (tp 1, pp 1, dp 0)': the prefix used in logs and error reports (cp named when it is used)."""
        at = self.coordinate(rank)
        cp = f", cp {at.cp}" if self.cp > 1 else ""
        return f"rank {rank} (tp {at.tp}{cp}, pp {at.pp}, dp {at.dp})"

    def _groups_along(self, *axes: str) -> list[list[int]]:
        """All groups whose members differ only along ``axes``; members sorted by rank."""
        fixed = [a for a in AXES if a not in axes]
        groups = []
        for fixed_values in product(*(range(self.sizes[a]) for a in fixed)):
            base = dict(zip(fixed, fixed_values))
            members = [self.rank_of(**base, **dict(zip(axes, varying)))
                       for varying in product(*(range(self.sizes[a]) for a in axes))]
            groups.append(sorted(members))
        return sorted(groups)

    def tp_groups(self) -> list[list[int]]:
        return self._groups_along("tp")

    def pp_groups(self) -> list[list[int]]:
        """Each group lists its ranks in stage order (stage 0 first)."""
        groups = []
        for tp, cp, dp in product(range(self.tp), range(self.cp), range(self.dp)):
            groups.append([self.rank_of(tp=tp, pp=stage, dp=dp, cp=cp) for stage in range(self.pp)])
        return sorted(groups)

    def cp_groups(self) -> list[list[int]]:
        """The context-parallel rings: members in cp order, which is the ring's order."""
        groups = []
        for tp, pp, dp in product(range(self.tp), range(self.pp), range(self.dp)):
            groups.append([self.rank_of(tp=tp, pp=pp, dp=dp, cp=cp) for cp in range(self.cp)])
        return sorted(groups)

    def cp_a2a_groups(self) -> list[list[int]]:
        """a2a+ring: each CP ring cut into runs of ``cp_a2a`` consecutive members (the all-to-all groups)."""
        return sorted(ring[start:start + self.cp_a2a] for ring in self.cp_groups()
                      for start in range(0, self.cp, self.cp_a2a))

    def cp_ring_groups(self) -> list[list[int]]:
        """a2a+ring: the members at the same place in every all-to-all group of a CP ring (the rings)."""
        return sorted(ring[offset::self.cp_a2a] for ring in self.cp_groups() for offset in range(self.cp_a2a))

    def dp_groups(self) -> list[list[int]]:
        return self._groups_along("dp")

    def dp_cp_groups(self) -> list[list[int]]:
        """Ranks holding replicas of the same weights: gradients, ZeRO shards and the loss reduce over these."""
        return self._groups_along("dp", "cp")

    def ep_groups(self) -> list[list[int]]:
        """Expert-parallel groups: ep consecutive data-parallel ranks, members in ep order (expert shares)."""
        groups = []
        for tp, cp, pp, block in product(range(self.tp), range(self.cp), range(self.pp), range(self.dp // self.ep)):
            groups.append([self.rank_of(tp=tp, pp=pp, dp=block * self.ep + e, cp=cp) for e in range(self.ep)])
        return sorted(groups)

    def expert_groups(self) -> list[list[int]]:
        """The ranks that share the experts out and exchange tokens: the ep groups, or with expert TP 1 the
        tp x ep ranks (members sorted by rank: a member's index says which share it holds)."""
        if self.expert_tp == self.tp:
            return self.ep_groups()
        groups = []
        for cp, pp, block in product(range(self.cp), range(self.pp), range(self.dp // self.ep)):
            groups.append(sorted(self.rank_of(tp=tp, pp=pp, dp=block * self.ep + share, cp=cp)
                                 for tp, share in product(range(self.tp), range(self.ep))))
        return sorted(groups)

    def expert_dp_groups(self) -> list[list[int]]:
        """Ranks holding replicas of the same experts: expert gradients and ZeRO shards reduce over these."""
        groups = []
        for tp, pp, share in product(range(self.tp), range(self.pp), range(self.ep)):
            groups.append(sorted(self.rank_of(tp=tp, pp=pp, dp=block * self.ep + share, cp=cp)
                                 for block, cp in product(range(self.dp // self.ep), range(self.cp))))
        return sorted(groups)

    def model_parallel_groups(self) -> list[list[int]]:
        return self._groups_along("tp", "pp")

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline: where tied input embedding and output head live."""
        return [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in self.pp_groups()]

    def is_first_stage(self, rank: int) -> bool:
        return self.coordinate(rank).pp == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.coordinate(rank).pp == self.pp - 1

    def next_pp_rank(self, rank: int) -> int:
        """The rank holding the next stage (wrapping, as interleaved schedules need)."""
        c = self.coordinate(rank)
        return self.rank_of(tp=c.tp, pp=(c.pp + 1) % self.pp, dp=c.dp, cp=c.cp)

    def prev_pp_rank(self, rank: int) -> int:
        c = self.coordinate(rank)
        return self.rank_of(tp=c.tp, pp=(c.pp - 1) % self.pp, dp=c.dp, cp=c.cp)

    def rank_map(self, hosts: list[str] | None = None) -> str:
        """A compact table: global rank -> host, tp, cp, pp, dp."""
        experts = f"; ep {self.ep} of dp" if self.ep > 1 else ""
        lines = [f"topology: world {self.world_size} = tp {self.tp} x cp {self.cp} x pp {self.pp} x dp {self.dp} "
                 f"(order {self.order}, innermost first; virtual pp {self.virtual_pp}{experts})",
                 "rank  host              tp  cp  pp  dp"]
        for rank in range(self.world_size):
            c = self.coordinate(rank)
            host = hosts[rank] if hosts else "-"
            lines.append(f"{rank:>4}  {host:<16}  {c.tp:>2}  {c.cp:>2}  {c.pp:>2}  {c.dp:>2}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Topology(world_size={self.world_size}, tp={self.tp}, cp={self.cp}, pp={self.pp}, dp={self.dp}, "
                f"virtual_pp={self.virtual_pp}, order={self.order!r}, ep={self.ep}, expert_tp={self.expert_tp})")
