"""Checkpoint state of the sharded optimizer, in a layout-free form.

Saved: for every parameter (by global name) its fp32 master weight and optimizer states at the
parameter's TP-local shape, plus the loss scaler and the step count. Nothing depends on the DP size,
the ZeRO stage or the bucket size, so a run saved at dp = 2 / ZeRO-1 resumes at dp = 4 / ZeRO-2:
each rank simply cuts its new shard out of the full tensors it is given.
"""
from __future__ import annotations

import torch

from ..parallel.strict import to_host
from .param_groups import STATE_KEYS, uses_apex


def gather_checkpoint_state(dopt, finish=None) -> dict | None:
    """Collective over DP (one all-gather per bucket and key); the result on DP rank 0, None elsewhere.

    ``finish(name, value)`` turns each parameter's DP-gathered device tensor into what is kept (default:
    a host copy); the checkpoint's joins TP shards first, on the device, one bucket at a time.
    """
    finish = finish or (lambda name, value: to_host(value))
    keys = ("master",) + STATE_KEYS[dopt.opt.name]
    states = dopt.optimizer.state if dopt.optimizer is not None else {}
    params: dict[str, dict] = {}
    for buffer in dopt.buffers:
        for bucket in buffer.buckets:
            owned = [(f, m) for f, m in zip(dopt.fragments, dopt.masters) if f.bucket is bucket]
            for key in keys:
                shard = torch.zeros(bucket.shard_size, dtype=torch.float32, device=buffer.device)
                for fragment, master in owned:
                    value = master if key == "master" else states.get(master, {}).get(key)
                    if value is not None:
                        shard[fragment.shard_offset:fragment.shard_offset + master.numel()] = value
                full = buffer.gather_bucket(bucket, shard)
                if dopt.dp_rank != 0:
                    continue
                for param, offset in zip(bucket.params, bucket.offsets):
                    value = full[offset:offset + param.numel()].view(param.shape)
                    name = dopt.names[id(param)]
                    params.setdefault(name, {})[key] = finish(name, value)
    if dopt.dp_rank != 0:
        return None
    return {"params": params, "scaler": dopt.scaler.state_dict(), "step": dopt.steps}


def _entry(params: dict, name: str, key: str, param: torch.Tensor) -> torch.Tensor:
    if name not in params or key not in params[name]:
        raise KeyError(f"optimizer checkpoint: no {key!r} for parameter {name!r}. Fix: load a checkpoint saved "
                       f"by state_dict_for_checkpoint() of the same model and optimizer.name.")
    value = params[name][key]
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"optimizer checkpoint: {name}/{key} has shape {tuple(value.shape)}, this rank's "
                         f"parameter has {tuple(param.shape)}. Fix: reshard the checkpoint to this TP layout "
                         f"before loading (tools/convert_checkpoint.py).")
    return value


@torch.no_grad()
def load_checkpoint_state(dopt, state: dict) -> None:
    """Weights and masters from "master"; optimizer states for this rank's shard; scaler; step."""
    params, step = state["params"], int(state["step"])
    for buffer in dopt.buffers:
        for param in buffer.params:
            param.copy_(_entry(params, dopt.names[id(param)], "master", param))
    for fragment, master in zip(dopt.fragments, dopt.masters):
        if master is not fragment.data:
            full = _entry(params, dopt.names[id(fragment.param)], "master", fragment.param)
            master.copy_(full.reshape(-1)[fragment.start:fragment.end])
    if dopt.optimizer is not None and step > 0:
        _load_optimizer_states(dopt, params, step)
    dopt.scaler.load_state_dict(state["scaler"])
    dopt.steps = step


def _load_optimizer_states(dopt, params: dict, step: int) -> None:
    """Through the inner optimizer's own load_state_dict, which places states on the master's device."""
    fragment_of = {id(m): f for m, f in zip(dopt.masters, dopt.fragments)}
    keys = STATE_KEYS[dopt.opt.name]
    packed = dopt.optimizer.state_dict()
    per_index, index = {}, 0
    for group in dopt.optimizer.param_groups:
        for master in group["params"]:
            fragment = fragment_of[id(master)]
            name = dopt.names[id(fragment.param)]
            entry = {key: _entry(params, name, key, fragment.param).reshape(-1)[fragment.start:fragment.end].clone()
                     for key in keys}
            if dopt.opt.name == "adamw":
                entry["step"] = torch.tensor(float(step))
            per_index[index] = entry
            index += 1
    packed["state"] = per_index
    if uses_apex(dopt.opt, dopt.device):  # apex counts steps per group, not per tensor
        for group in packed["param_groups"]:
            group["step"] = step
    dopt.optimizer.load_state_dict(packed)
