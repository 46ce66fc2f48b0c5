"""Moving a stage's tensors to and from full-size tensors with global names.

Full-size means as on one device: TP shards concatenated and vocabulary padding removed.
Checkpoints (parameters and optimizer states), resharding and HF conversion all go through
``gather_full`` / ``shard_full``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.strict import to_host
from ..tensor_parallel.context import LayerContext
from ..tensor_parallel.regions import stored_shape
from ..tensor_parallel.sharding import ParamInfo, shard, unshard
from .language_model import LanguageModel


def shard_full(full: torch.Tensor, info: ParamInfo, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's slice of a full tensor, as ``info`` (a sharding-table row) says (vocab padding re-applied)."""
    if info.vocab_rows is not None and full.shape[0] != info.spec.full_size:
        padded = full.new_zeros((info.spec.full_size,) + tuple(full.shape[1:]))
        padded[:full.shape[0]] = full
        full = padded
    return shard(full, info.spec, tp_rank, tp)


def gather_full(local: torch.Tensor, info: ParamInfo, tp_group=None) -> torch.Tensor:
    """The full tensor, in host memory, from every TP rank's ``local`` (laid out as ``info`` says); collective
    over TP.

    The shards are joined on their device and only the result goes to the host: an NCCL group takes
    device tensors only.
    """
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    full = local.detach()
    if info.spec is not None and tp > 1:
        pieces = [torch.empty_like(full) for _ in range(tp)]
        dist.all_gather(pieces, full.contiguous(), group=tp_group)
        full = unshard(pieces, info.spec)
    return to_host(full[:info.vocab_rows] if info.vocab_rows is not None else full)


def stored_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this model stores, by global name, at its stored (full, unpadded) shape:
    the whole model built on the meta device, so nothing is allocated however large it is (~0.2 s for 70B)."""
    model = LanguageModel(model_cfg, LayerContext(device=torch.device("meta")))
    return {name: stored_shape(param.shape, info) for name, param, info in saved_parameters(model)}


def saved_parameters(model):
    """(global name, param, sharding-table row) a checkpoint stores: a tied head's copy of the embedding is
    stored once, by the stage that owns the original."""
    table = model.sharding()
    for name, param in model.named_global_parameters():
        if table[name].tied_to is None:
            yield name, param, table[name]


@torch.no_grad()
def load_full_state_dict(model, state: dict, tp_rank: int = 0, tp: int = 1, strict: bool = True) -> list[str]:
    """Copy this rank's shard of every full tensor in ``state`` into ``model``; returns missing names."""
    missing, table = [], model.sharding()
    for name, param in model.named_global_parameters():
        if name not in state:
            missing.append(name)
            continue
        local = shard_full(state[name].to(torch.float32), table[name], tp_rank, tp)
        if local.shape != param.shape:
            raise ValueError(f"checkpoint tensor {name}: full shape {tuple(state[name].shape)} gives a shard of "
                             f"{tuple(local.shape)} at tp = {tp}, but the model expects {tuple(param.shape)}. "
                             f"Fix: the checkpoint is from a different model.* shape; compare its config.")
        param.copy_(local)
    if strict and missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    return missing


@torch.no_grad()
def full_state_dict(model, tp_group=None) -> dict:
    """Every stored parameter of this stage as a full-size host tensor (collective over TP)."""
    return {name: gather_full(param, info, tp_group) for name, param, info in saved_parameters(model)}
