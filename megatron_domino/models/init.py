"""Weight initialisation that does not depend on the parallel layout.

Each parameter's full-size tensor is drawn from a generator seeded by (seed, global name),
then this rank keeps its TP slice. So a model at tp = 4, pp = 2 starts from exactly the
weights of the same model on one device. Only one full tensor exists at a time, on the CPU.
"""
from __future__ import annotations

import zlib

import torch

from ..tensor_parallel.sharding import ParamInfo, shard, sharding_table


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def full_init_tensor(shape: tuple[int, ...], info: ParamInfo, name: str, seed: int) -> torch.Tensor:
    """The full-size initial value of the parameter ``name`` (fp32, CPU)."""
    if info.init == "zeros":
        return torch.zeros(shape)
    if info.init == "ones":
        return torch.ones(shape)
    if info.vocab_rows is None:
        return torch.empty(shape).normal_(0.0, info.std, generator=_generator(seed, name))
    full = torch.zeros(shape)  # padded vocabulary rows stay zero; real rows do not depend on the padding
    full[:info.vocab_rows].normal_(0.0, info.std, generator=_generator(seed, name))
    return full


@torch.no_grad()
def initialize_weights(model, seed: int, tp_rank: int = 0, tp: int = 1) -> None:
    """Every parameter from its full-size initial value, as its sharding-table row says."""
    table = sharding_table(model)
    rename = getattr(model, "global_name", lambda name: name)
    for name, param in model.named_parameters():
        info = table[name]
        global_name = info.tied_to or rename(name)
        param.copy_(shard(full_init_tensor(info.full_shape(param.shape), info, global_name, seed), info.spec, tp_rank, tp))
