"""Weight initialisation that does not depend on the parallel layout.

Each parameter's full-size tensor is drawn from a generator seeded by (seed, global name),
then this rank keeps its TP slice. So a model at tp = 4, pp = 2 starts from exactly the
weights of the same model on one device. Only one full tensor exists at a time, on the CPU.
"""
from __future__ import annotations

import zlib

import torch

from ..tensor_parallel.sharding import get_shard_spec, shard


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    spec = get_shard_spec(param)
    shape = list(param.shape)
    if spec is not None:
        shape[spec.dim] = spec.full_size
    return tuple(shape)


def full_init_tensor(param: torch.Tensor, name: str, seed: int) -> torch.Tensor:
    """The full-size initial value of ``param`` (fp32, CPU)."""
    shape = full_shape(param)
    kind = getattr(param, "init_kind", "normal")
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    rows = getattr(param, "vocab_rows", None)
    if rows is None:
        return torch.empty(shape).normal_(0.0, param.init_std, generator=_generator(seed, name))
    full = torch.zeros(shape)  # padded vocabulary rows stay zero; real rows do not depend on the padding
    full[:rows].normal_(0.0, param.init_std, generator=_generator(seed, name))
    return full


@torch.no_grad()
def initialize_weights(model, seed: int, tp_rank: int = 0, tp: int = 1) -> None:
    for name, param in model.named_global_parameters():
        full = full_init_tensor(param, name, seed)
        param.copy_(shard(full, get_shard_spec(param), tp_rank, tp))
