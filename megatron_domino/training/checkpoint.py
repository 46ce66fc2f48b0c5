"""Checkpoints that are atomic, resumable bit for bit, and loadable at any parallel layout.

Layout of ``<checkpoint.dir>/step_00000020/``:
    metadata.json             version, step, data position, LR schedule, loss scaler, layout, config
    model-pp000.safetensors   full-size parameters of pipeline rank 0's chunks (global names)
    optim-pp000.safetensors   full-size fp32 optimizer state: "<param>/master", "<param>/exp_avg", ...
    rng/rank00000.pt          each rank's RNG streams (restored only at the same layout)
Tensors are stored full-size (TP shards joined, ZeRO shards gathered, vocab padding removed),
so loading at another (tp, pp, dp, ZeRO stage) only re-slices. Files are written into
``.tmp-step_...``, fsynced, renamed into place, and ``latest`` is replaced last: a crash at any
moment leaves ``latest`` naming a whole checkpoint. Loading never unpickles code.

Saving and loading are phases with their own budgets (``checkpoint.save_timeout_s``/``load_timeout_s``):
their waits for the other ranks go over the store, not through collectives that the collective timeout
would abort, and they report progress so the watchdog tells a slow save from a hung one.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config.loader import config_from_dict, config_to_dict
from ..models.full_state import gather_full, load_full_state_dict, saved_parameters, shard_full
from ..parallel.random import capture_rng_state, restore_rng_state
from ..parallel.store_barrier import Phase

VERSION = 1
LATEST = "latest"
# Model settings that change tensor shapes or the function computed; a checkpoint must agree on them.
SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_size", "num_attention_heads", "query_groups", "head_dim",
              "vocab_size", "position_embedding", "norm", "activation", "bias", "tie_embeddings", "max_positions")


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: str, payload) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def save_phase(cfg) -> Phase:
    return Phase("checkpoint save", cfg.checkpoint.save_timeout_s, "checkpoint.save_timeout_s")


def load_phase(cfg) -> Phase:
    return Phase("checkpoint load", cfg.checkpoint.load_timeout_s, "checkpoint.load_timeout_s")


def _optimizer_tensors(chunks, optimizer, state) -> tuple[dict[str, torch.Tensor], dict]:
    """Full-size optimizer tensors named '<param>/<key>', and the rest of the optimizer's state (scaler, step).

    Collective over DP, then over TP on DP rank 0; other ranks get nothing back.
    """
    params = {name: p for chunk in chunks for name, p in saved_parameters(chunk)}
    gathered = optimizer.state_dict_for_checkpoint(
        finish=lambda name, value: gather_full(value, params[name], state.tp_group) if name in params else None)
    if state.dp_rank != 0:
        return {}, {}
    tensors = {f"{name}/{key}": full for name in params for key, full in gathered["params"][name].items()}
    return tensors, {k: v for k, v in gathered.items() if k != "params"}


def save_checkpoint(root: str, step: int, *, chunks, optimizer, schedule, consumed_samples: int, cfg, state,
                    keep: int, phase: Phase | None = None) -> str:
    """Write a checkpoint of ``step`` under ``root`` (collective over every rank); returns its directory.

    ``phase`` (default ``save_phase(cfg)``) receives the progress; pass the one the watchdog watches.
    """
    phase = phase or save_phase(cfg)
    tmp = os.path.join(root, ".tmp-" + step_dir_name(step))
    if state.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"))
    phase.barrier("temporary directory created")
    phase.progress("gathering the model and optimizer state")
    model = {}
    if state.dp_rank == 0:
        for chunk in chunks:
            model.update({n: gather_full(p, p, state.tp_group) for n, p in saved_parameters(chunk)})
    optim, optim_meta = _optimizer_tensors(chunks, optimizer, state)
    if state.dp_rank == 0 and state.tp_rank == 0:
        for prefix, tensors in (("model", model), ("optim", optim)):
            path = os.path.join(tmp, f"{prefix}-pp{state.pp_rank:03d}.safetensors")
            phase.progress(f"writing {path}")
            save_file({k: v.contiguous() for k, v in tensors.items()}, path)
            _fsync_file(path)
    rng_path = os.path.join(tmp, "rng", f"rank{state.rank:05d}.pt")
    torch.save(capture_rng_state(), rng_path)
    _fsync_file(rng_path)
    phase.barrier("every file written")
    final = os.path.join(root, step_dir_name(step))
    if state.rank == 0:
        metadata = {"version": VERSION, "step": step, "consumed_samples": consumed_samples,
                    "has_optimizer": True, "lr_schedule": schedule.state_dict(), "optimizer": optim_meta,
                    "layout": _layout(state, cfg), "config": config_to_dict(cfg)}
        _fsync_dir(os.path.join(tmp, "rng"))
        phase.progress("publishing")
        publish_step_dir(root, tmp, metadata, keep)
    phase.barrier("published")
    return final


def publish_step_dir(root: str, tmp: str, metadata: dict, keep: int = 0) -> str:
    """Write metadata.json into ``tmp``, fsync, rename it to its step_* name, then point ``latest`` at it.

    Until the final replace of ``latest``, a reader still sees the previous whole checkpoint.
    """
    _write_json_atomic(os.path.join(tmp, "metadata.json"), metadata)
    _fsync_dir(tmp)
    final = os.path.join(root, step_dir_name(metadata["step"]))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_json_atomic(os.path.join(root, LATEST), {"step": metadata["step"], "dir": step_dir_name(metadata["step"])})
    _fsync_dir(root)
    _prune(root, keep)
    return final


def _layout(state, cfg) -> dict:
    return {"tp": state.tp_size, "pp": state.pp_size, "dp": state.dp_size, "virtual_pp": state.virtual_pp,
            "zero_stage": cfg.optimizer.zero_stage}


def _prune(root: str, keep: int) -> None:
    if keep <= 0:
        return
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    for stale in steps[:-keep]:
        shutil.rmtree(os.path.join(root, stale), ignore_errors=True)


def resolve_load_path(load: str | None, checkpoint_dir: str | None) -> str | None:
    """``checkpoint.load``: a directory, or "auto" for ``latest`` in checkpoint.dir (None when there is none yet)."""
    if load is None:
        return None
    if load != "auto":
        if os.path.exists(os.path.join(load, LATEST)):  # a checkpoint root was given: take its latest
            return resolve_load_path("auto", load)
        return load
    pointer = os.path.join(checkpoint_dir, LATEST)
    if not os.path.exists(pointer):
        return None
    with open(pointer, encoding="utf-8") as f:
        return os.path.join(checkpoint_dir, json.load(f)["dir"])


def read_metadata(path: str) -> dict:
    meta_path = os.path.join(path, "metadata.json")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"checkpoint.load = {path!r}: no metadata.json there. Fix: point it at a "
                                f"step_* directory or a checkpoint root with a 'latest' file.")
    with open(meta_path, encoding="utf-8") as f:
        metadata = json.load(f)
    if metadata.get("version") != VERSION:
        raise ValueError(f"checkpoint {path}: format version {metadata.get('version')} is not {VERSION}")
    return metadata


def check_compatible(metadata: dict, model_cfg) -> None:
    """Refuse a checkpoint of a different model, naming every differing key."""
    saved = config_from_dict({"model": metadata["config"]["model"]}).model
    differing = [f"model.{k}: checkpoint {getattr(saved, k)!r} vs config {getattr(model_cfg, k)!r}"
                 for k in SHAPE_KEYS if getattr(saved, k) != getattr(model_cfg, k)]
    if differing:
        raise ValueError("checkpoint is from an incompatible model; differing keys:\n  " + "\n  ".join(differing)
                         + "\nFix: load it with the model settings it was saved with.")


def _open_tensors(path: str, prefix: str) -> dict:
    """name -> (file, key) for every tensor in '<prefix>-pp*.safetensors', read lazily."""
    index = {}
    for file in sorted(f for f in os.listdir(path) if f.startswith(prefix + "-") and f.endswith(".safetensors")):
        with safe_open(os.path.join(path, file), framework="pt") as handle:
            for key in handle.keys():
                index[key] = os.path.join(path, file)
    return index


def _read(index: dict, names) -> dict:
    by_file, out = {}, {}
    for name in names:
        if name in index:
            by_file.setdefault(index[name], []).append(name)
    for file, keys in by_file.items():
        with safe_open(file, framework="pt") as handle:
            for key in keys:
                out[key] = handle.get_tensor(key)
    return out


def load_checkpoint(path: str, *, chunks, optimizer, schedule, cfg, state, phase: Phase | None = None) -> dict:
    """Load weights (and optimizer, schedule, RNG where present) into this rank; returns the metadata.

    Ends when every rank has loaded, so no rank's first collective waits out a slow reader.
    """
    phase = phase or load_phase(cfg)
    metadata = read_metadata(path)
    check_compatible(metadata, cfg.model)
    phase.progress("reading the model weights")
    index = _open_tensors(path, "model")
    names = {n for chunk in chunks for n, _ in chunk.named_global_parameters()}
    weights = _read(index, names)
    for chunk in chunks:
        load_full_state_dict(chunk, weights, state.tp_rank, state.tp_size)
    if metadata.get("has_optimizer") and optimizer is not None:
        phase.progress("reading the optimizer state")
        _load_optimizer(path, chunks, optimizer, metadata, state)
        schedule.load_state_dict(metadata["lr_schedule"])
    rng_file = os.path.join(path, "rng", f"rank{state.rank:05d}.pt")
    if metadata.get("layout") == _layout(state, cfg) and os.path.exists(rng_file):
        restore_rng_state(torch.load(rng_file, weights_only=True))
    phase.barrier("loaded")
    return metadata


def _load_optimizer(path: str, chunks, optimizer, metadata: dict, state) -> None:
    index = _open_tensors(path, "optim")
    params = {name: p for chunk in chunks for name, p in chunk.named_global_parameters()}
    stored = _read(index, [k for k in index if k.split("/")[0] in params])
    per_param: dict[str, dict] = {}
    for key, full in stored.items():
        name, field = key.split("/", 1)
        per_param.setdefault(name, {})[field] = shard_full(full, params[name], state.tp_rank, state.tp_size)
    missing = sorted(set(params) - set(per_param))
    if missing:
        raise KeyError(f"checkpoint {path} has no optimizer state for {missing[:3]} ... Fix: load with "
                       f"optimizer state from a full training checkpoint, or start the optimizer fresh.")
    optimizer.load_state_dict_from_checkpoint({"params": per_param, **metadata["optimizer"]})
