"""How a full-size tensor maps onto TP shards, and back.

A ``ShardSpec`` says how a tensor-parallel tensor is split: the dimension and the logical parts that
are split separately (SwiGLU's gate and up projections are two parts of one fused weight; each part
is cut into tp pieces, and a rank holds its piece of every part). One spec serves sharded
initialisation (so tp = 1 and tp = 4 start from identical weights), checkpoint resharding and HF
conversion.

Each model has a sharding table (``sharding_table``): one ``ParamInfo`` per parameter, declared by
the layer that creates it, which everything else reads (initialisation, checkpoints, gradient
norms, the sequence-parallel reduction) instead of attributes on the parameters.
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


@dataclass(frozen=True)
class ParamInfo:
    """One row of a model's sharding table: how a parameter is split, initialised and reduced."""

    spec: ShardSpec | None = None  # split across TP; None: replicated
    init: str = "normal"  # normal | zeros | ones
    std: float = 0.0  # of the normal initialisation
    # replicated, but fed a different slice per TP rank (sequence parallelism) or a partial: gradients sum over TP
    grad_sums_over_tp: bool = False
    vocab_rows: int | None = None  # rows past this are vocabulary padding (zero, never trained)
    tied_to: str | None = None  # a copy of this global parameter (a tied output head on another stage)
    expert: bool = False  # an expert's: replicated over the expert-data-parallel group, not all of dp
    tp_replicated: bool = True  # unsplit (spec None) and the same on every TP rank; False: each TP rank's own
    matrix: bool = False  # a hidden layer's 2-D weight (attention, MLP, experts): what Muon orthogonalizes
    blocks: tuple[int, ...] | None = None  # rows of separate matrices fused into this one otherwise than by spec parts
    heads: tuple[int, int, int] | None = None  # a fused QKV: (query groups, queries per group, head dim), group-major

    def full_shape(self, local_shape) -> tuple[int, ...]:
        """The shape of the full tensor (vocabulary padding included) whose TP slice has ``local_shape``."""
        shape = list(local_shape)
        if self.spec is not None:
            shape[self.spec.dim] = self.spec.full_size
        return tuple(shape)

    def counts_once(self, tp_rank: int) -> bool:
        """Whether this rank's copy counts in global sums (norms): split ones and each TP rank's own (whole
        experts of expert-TP 1) everywhere, replicated ones on TP rank 0, copies of a tied parameter never."""
        return (self.spec is not None or not self.tp_replicated or tp_rank == 0) and self.tied_to is None


def declare(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None, info: ParamInfo) -> None:
    """Register ``param`` on ``module`` with its row of the sharding table (see ``sharding_table``)."""
    setattr(module, name, param)
    if param is not None:
        module.__dict__.setdefault("param_info", {})[name] = info


def sharding_table(model: torch.nn.Module) -> dict[str, ParamInfo]:
    """Local parameter name -> ``ParamInfo`` for every parameter of ``model``, from what its layers declared."""
    table = {}
    for prefix, module in model.named_modules():
        for name, info in module.__dict__.get("param_info", {}).items():
            table[f"{prefix}.{name}" if prefix else name] = info
    missing = [name for name, _ in model.named_parameters() if name not in table]
    if missing:
        raise ValueError(f"parameters {missing[:3]} have no sharding-table row: create them with "
                         f"tensor_parallel.sharding.declare(module, name, param, ParamInfo(...))")
    return table


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
