"""How a full-size tensor maps onto TP shards, and back.

Each tensor-parallel parameter carries a ``ShardSpec``: the dimension it is split along and
the logical parts that are split separately (SwiGLU's gate and up projections are two parts of
one fused weight; each part is cut into tp pieces, and a rank holds its piece of every part).
One spec serves sharded initialisation (so tp = 1 and tp = 4 start from identical weights),
checkpoint resharding and HF conversion.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    dim: int  # split dimension of the full tensor
    parts: tuple[int, ...]  # full sizes of the separately split parts along ``dim``

    @property
    def full_size(self) -> int:
        return sum(self.parts)

    def local_size(self, tp: int) -> int:
        return sum(self._piece(part, tp) for part in self.parts)

    @staticmethod
    def _piece(part: int, tp: int) -> int:
        if part % tp:
            raise ValueError(f"a tensor-parallel dimension of size {part} cannot be split across tp = {tp}. "
                             f"Fix: choose parallel.tp dividing {part}.")
        return part // tp


def set_shard_spec(param: torch.Tensor, spec: ShardSpec | None) -> None:
    """Mark a parameter as split (spec) or replicated across TP (None)."""
    param.shard_spec = spec


def get_shard_spec(param: torch.Tensor) -> ShardSpec | None:
    return getattr(param, "shard_spec", None)


def is_tp_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    """True for a replicated parameter on a TP rank other than 0: count it once, not tp times."""
    return get_shard_spec(param) is None and tp_rank != 0


def shard(full: torch.Tensor, spec: ShardSpec | None, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's slice of ``full`` (a copy; the full tensor may be freed)."""
    if spec is None or tp == 1:
        return full.clone()
    pieces, offset = [], 0
    for part in spec.parts:
        size = ShardSpec._piece(part, tp)
        pieces.append(full.narrow(spec.dim, offset + tp_rank * size, size))
        offset += part
    return torch.cat(pieces, dim=spec.dim).clone()


def unshard(shards: list[torch.Tensor], spec: ShardSpec | None) -> torch.Tensor:
    """The full tensor from every TP rank's slice, in TP rank order."""
    if spec is None or len(shards) == 1:
        return shards[0].clone()
    tp = len(shards)
    per_part = [[] for _ in spec.parts]
    for piece in shards:
        offset = 0
        for index, part in enumerate(spec.parts):
            size = part // tp
            per_part[index].append(piece.narrow(spec.dim, offset, size))
            offset += size
    return torch.cat([torch.cat(p, dim=spec.dim) for p in per_part], dim=spec.dim)
