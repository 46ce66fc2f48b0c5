"""The rank grid: which global rank sits at which (tp, pp, dp) coordinate, and the groups that follow.

A ``Topology`` is plain arithmetic (no processes), so layouts can be checked and printed
on one CPU process for a 1024-GPU job. ``ProcessGroups`` turns it into torch.distributed
groups once a process group exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from ..config.schema import AXES


@dataclass(frozen=True)
class Coordinate:
    tp: int
    pp: int
    dp: int


class Topology:
    """World size cut into tp x pp x dp; ``order`` names the axes innermost first ("tp-dp-pp")."""

    def __init__(self, world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None,
                 virtual_pp: int = 1, order: str = "tp-dp-pp"):
        for name, value in (("world_size", world_size), ("parallel.tp", tp), ("parallel.pp", pp),
                            ("parallel.virtual_pp", virtual_pp)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}: must be a positive integer. Fix: set it to 1 or more.")
        if dp is None:
            if world_size % (tp * pp):
                raise ValueError(
                    f"parallel.tp * parallel.pp = {tp * pp}: must divide the world size {world_size} to infer "
                    f"parallel.dp. Fix: launch a multiple of {tp * pp} ranks or change tp/pp.")
            dp = world_size // (tp * pp)
        if tp * pp * dp != world_size:
            raise ValueError(
                f"parallel.dp = {dp}: tp * pp * dp = {tp}*{pp}*{dp} = {tp * pp * dp} must equal the world size "
                f"{world_size}. Fix: set parallel.dp={world_size // (tp * pp) if world_size % (tp * pp) == 0 else '?'} "
                f"or launch {tp * pp * dp} ranks.")
        axes = order.split("-")
        if sorted(axes) != sorted(AXES):
            raise ValueError(f"parallel.order = {order!r}: must be a permutation of tp, dp, pp joined by '-'. "
                             f"Fix: use 'tp-dp-pp' (TP innermost, Megatron's default).")
        self.world_size, self.tp, self.pp, self.dp = world_size, tp, pp, dp
        self.virtual_pp, self.order = virtual_pp, order
        self.sizes = {"tp": tp, "pp": pp, "dp": dp}
        self._strides = {}
        stride = 1
        for axis in axes:
            self._strides[axis] = stride
            stride *= self.sizes[axis]

    def rank_of(self, tp: int = 0, pp: int = 0, dp: int = 0) -> int:
        """Global rank at a coordinate."""
        coordinate = {"tp": tp, "pp": pp, "dp": dp}
        for axis, value in coordinate.items():
            if not 0 <= value < self.sizes[axis]:
                raise ValueError(f"{axis} coordinate {value} outside 0..{self.sizes[axis] - 1}")
        return sum(coordinate[a] * self._strides[a] for a in AXES)

    def coordinate(self, rank: int) -> Coordinate:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")
        return Coordinate(**{a: (rank // self._strides[a]) % self.sizes[a] for a in AXES})

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
        for tp, dp in product(range(self.tp), range(self.dp)):
            groups.append([self.rank_of(tp=tp, pp=stage, dp=dp) for stage in range(self.pp)])
        return sorted(groups)

    def dp_groups(self) -> list[list[int]]:
        return self._groups_along("dp")

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
        return self.rank_of(tp=c.tp, pp=(c.pp + 1) % self.pp, dp=c.dp)

    def prev_pp_rank(self, rank: int) -> int:
        c = self.coordinate(rank)
        return self.rank_of(tp=c.tp, pp=(c.pp - 1) % self.pp, dp=c.dp)

    def rank_map(self, hosts: list[str] | None = None) -> str:
        """A compact table: global rank -> host, tp, pp, dp."""
        lines = [f"topology: world {self.world_size} = tp {self.tp} x pp {self.pp} x dp {self.dp} "
                 f"(order {self.order}, virtual pp {self.virtual_pp})",
                 "rank  host              tp  pp  dp"]
        for rank in range(self.world_size):
            c = self.coordinate(rank)
            host = hosts[rank] if hosts else "-"
            lines.append(f"{rank:>4}  {host:<16}  {c.tp:>2}  {c.pp:>2}  {c.dp:>2}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Topology(world_size={self.world_size}, tp={self.tp}, pp={self.pp}, dp={self.dp}, "
                f"virtual_pp={self.virtual_pp}, order={self.order!r})")
