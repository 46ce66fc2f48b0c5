"""Moving a stage's parameters to and from full-size tensors with global names.

Full-size means as on one device: TP shards concatenated and vocabulary padding removed.
Checkpoints, resharding and HF conversion all go through these two functions.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..tensor_parallel.sharding import get_shard_spec, shard, unshard


def _pad_vocab(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    spec = get_shard_spec(param)
    padded = spec.full_size if spec is not None else param.shape[0]
    if full.shape[0] == padded:
        return full
    out = full.new_zeros((padded,) + tuple(full.shape[1:]))
    out[:full.shape[0]] = full
    return out


@torch.no_grad()
def load_full_state_dict(model, state: dict, tp_rank: int = 0, tp: int = 1, strict: bool = True) -> list[str]:
    """Copy this rank's shard of every full tensor in ``state`` into ``model``; returns missing names."""
    missing = []
    for name, param in model.named_global_parameters():
        if name not in state:
            missing.append(name)
            continue
        full = state[name]
        if getattr(param, "vocab_rows", None) is not None:
            full = _pad_vocab(full, param)
        local = shard(full.to(torch.float32), get_shard_spec(param), tp_rank, tp)
        if local.shape != param.shape:
            raise ValueError(f"checkpoint tensor {name}: full shape {tuple(full.shape)} gives a shard of "
                             f"{tuple(local.shape)} at tp = {tp}, but the model expects {tuple(param.shape)}. "
                             f"Fix: the checkpoint is from a different model.* shape; compare its config.")
        param.copy_(local)
    if strict and missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    return missing


@torch.no_grad()
def full_state_dict(model, tp_group=None) -> dict:
    """Gather every parameter of this stage over TP into full-size CPU tensors (collective over TP)."""
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    state = {}
    for name, param in model.named_global_parameters():
        spec = get_shard_spec(param)
        if spec is None or tp == 1:
            full = param.detach().cpu().clone()
        else:
            pieces = [torch.empty_like(param) for _ in range(tp)]
            dist.all_gather(pieces, param.detach().contiguous(), group=tp_group)
            full = unshard([p.cpu() for p in pieces], spec)
        rows = getattr(param, "vocab_rows", None)
        state[name] = full[:rows].clone() if rows is not None else full
    return state
