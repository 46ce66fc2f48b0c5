"""Moving a stage's tensors to and from full-size tensors with global names.

Full-size means as on one device: TP shards concatenated and vocabulary padding removed.
Checkpoints (parameters and optimizer states), resharding and HF conversion all go through
``gather_full`` / ``shard_full``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.strict import to_host
from ..tensor_parallel.sharding import get_shard_spec, shard, unshard


def shard_full(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's slice of a full tensor shaped like ``param``'s full value (vocab padding re-applied)."""
    spec = get_shard_spec(param)
    if getattr(param, "vocab_rows", None) is not None and full.shape[0] != spec.full_size:
        padded = full.new_zeros((spec.full_size,) + tuple(full.shape[1:]))
        padded[:full.shape[0]] = full
        full = padded
    return shard(full, spec, tp_rank, tp)


def gather_full(local: torch.Tensor, param: torch.Tensor, tp_group=None) -> torch.Tensor:
    """The full tensor, in host memory, from every TP rank's ``local`` (shaped like ``param``); collective over TP.

    The shards are joined on their device and only the result goes to the host: an NCCL group takes
    device tensors only.
    """
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    spec = get_shard_spec(param)
    full = local.detach()
    if spec is not None and tp > 1:
        pieces = [torch.empty_like(full) for _ in range(tp)]
        dist.all_gather(pieces, full.contiguous(), group=tp_group)
        full = unshard(pieces, spec)
    rows = getattr(param, "vocab_rows", None)
    return to_host(full[:rows] if rows is not None else full)


def saved_parameters(model):
    """(global name, param) pairs a checkpoint stores: a tied head's copy of the embedding is stored once."""
    for name, param in model.named_global_parameters():
        if not hasattr(param, "canonical_name"):
            yield name, param


@torch.no_grad()
def load_full_state_dict(model, state: dict, tp_rank: int = 0, tp: int = 1, strict: bool = True) -> list[str]:
    """Copy this rank's shard of every full tensor in ``state`` into ``model``; returns missing names."""
    missing = []
    for name, param in model.named_global_parameters():
        if name not in state:
            missing.append(name)
            continue
        local = shard_full(state[name].to(torch.float32), param, tp_rank, tp)
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
    return {name: gather_full(param, param, tp_group) for name, param in saved_parameters(model)}
