"""Checkpoints that are atomic, resumable bit for bit, and loadable at any parallel layout.

The files and their names are ``checkpoint_format``'s. Tensors are stored full-size (TP shards joined,
ZeRO shards gathered, vocab padding removed), so loading at another (tp, pp, dp, ZeRO stage) only
re-slices. Loading never unpickles code.

Saving and loading are phases with their own budgets (``checkpoint.save_timeout_s``/``load_timeout_s``):
their waits for the other ranks go over the store, not through collectives that the collective timeout
would abort, and they report progress so the watchdog tells a slow save from a hung one.
"""
from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from .. import checkpoint_format as fmt
from ..checkpoint_format import resolve_load_path  # noqa: F401 - the trainer takes it from here
from ..config.loader import config_to_dict
from ..models.full_state import gather_full, load_full_state_dict, saved_parameters, shard_full
from ..parallel.random import capture_rng_state, restore_rng_state
from ..parallel.store_barrier import Phase


def save_phase(cfg) -> Phase:
    return Phase("checkpoint save", cfg.checkpoint.save_timeout_s, "checkpoint.save_timeout_s")


def load_phase(cfg) -> Phase:
    return Phase("checkpoint load", cfg.checkpoint.load_timeout_s, "checkpoint.load_timeout_s")


def _optimizer_tensors(chunks, optimizer, state) -> tuple[dict[str, torch.Tensor], dict]:
    """Full-size optimizer tensors named '<param>/<key>', and the rest of the optimizer's state (scaler, step).

    Collective over DP, then over TP on DP rank 0; other ranks get nothing back.
    """
    infos = {name: info for chunk in chunks for name, _, info in saved_parameters(chunk)}
    gathered = optimizer.state_dict_for_checkpoint(
        finish=lambda name, value: gather_full(value, infos[name], state.tp_group) if name in infos else None)
    if state.dp_rank != 0:
        return {}, {}
    tensors = {f"{name}/{key}": full for name in infos for key, full in gathered["params"][name].items()}
    return tensors, {k: v for k, v in gathered.items() if k != "params"}


def save_checkpoint(root: str, step: int, *, chunks, optimizer, schedule, consumed_samples: int, cfg, state,
                    keep: int, phase: Phase | None = None, run_id: str = "") -> str:
    """Write a checkpoint of ``step`` under ``root`` (collective over every rank); returns its directory.

    ``phase`` (default ``save_phase(cfg)``) receives the progress; pass the one the watchdog watches.
    ``run_id`` (the same on every rank) makes the temporary directory this run's own.
    """
    phase = phase or save_phase(cfg)
    tmp = fmt.tmp_step_dir(root, step, run_id)
    if state.rank == 0:
        os.makedirs(os.path.join(fmt.start_step_dir(root, step, run_id), "rng"))
    phase.barrier("temporary directory created")
    phase.progress("gathering the model and optimizer state")
    model = {}
    if state.dp_rank == 0:
        for chunk in chunks:
            model.update({n: gather_full(p, info, state.tp_group) for n, p, info in saved_parameters(chunk)})
    optim, optim_meta = _optimizer_tensors(chunks, optimizer, state)
    if state.dp_rank == 0 and state.tp_rank == 0:
        for prefix, tensors in (("model", model), ("optim", optim)):
            path = os.path.join(tmp, fmt.stage_file(prefix, state.pp_rank))
            phase.progress(f"writing {path}")
            save_file({k: v.contiguous() for k, v in tensors.items()}, path)
            fmt.fsync_file(path)
    rng_path = os.path.join(tmp, fmt.rng_file(state.rank))
    torch.save(capture_rng_state(), rng_path)
    fmt.fsync_file(rng_path)
    phase.barrier("every file written")
    final = os.path.join(root, fmt.step_dir_name(step))
    if state.rank == 0:
        meta = fmt.metadata(step, config_to_dict(cfg), _layout(state, cfg), consumed_samples=consumed_samples,
                            lr_schedule=schedule.state_dict(), optimizer=optim_meta)
        fmt.fsync_dir(os.path.join(tmp, "rng"))
        phase.progress("publishing")
        fmt.publish_step_dir(root, tmp, meta, keep)
    phase.barrier("published")
    return final


def _layout(state, cfg) -> dict:
    return fmt.layout(state.tp_size, state.pp_size, state.dp_size, state.virtual_pp, cfg.optimizer.zero_stage)


def load_checkpoint(path: str, *, chunks, optimizer, schedule, cfg, state, phase: Phase | None = None) -> dict:
    """Load weights (and optimizer, schedule, RNG where present) into this rank; returns the metadata.

    Ends when every rank has loaded, so no rank's first collective waits out a slow reader.
    """
    phase = phase or load_phase(cfg)
    metadata = fmt.read_metadata(path)
    fmt.check_compatible(metadata, cfg.model)
    missing_files = fmt.missing_files(path, metadata)
    if missing_files:
        raise fmt.damaged(path, f"{path} lacks {', '.join(missing_files)} (saved at pp = "
                                f"{metadata['layout']['pp']}, it holds one file per pipeline stage)")
    phase.progress("reading the model weights")
    index = fmt.tensor_index(path, "model")
    names = {n for chunk in chunks for n, _ in chunk.named_global_parameters()}
    _refuse_missing(path, "model", sorted(names - index.keys()))
    weights = fmt.read_tensors(index, names)
    for chunk in chunks:
        load_full_state_dict(chunk, weights, state.tp_rank, state.tp_size)
    if metadata.get("has_optimizer") and optimizer is not None:
        phase.progress("reading the optimizer state")
        _load_optimizer(path, chunks, optimizer, metadata, state)
        schedule.load_state_dict(metadata["lr_schedule"])
    rng_file = os.path.join(path, fmt.rng_file(state.rank))
    if metadata.get("layout") == _layout(state, cfg) and os.path.exists(rng_file):
        restore_rng_state(torch.load(rng_file, weights_only=True))
    phase.barrier("loaded")
    return metadata


def _refuse_missing(path: str, prefix: str, missing: list[str]) -> None:
    """A checkpoint whose '<prefix>-*' files lack parameters this model needs is refused, naming its files."""
    if missing:
        files = ", ".join(os.path.basename(f) for f in fmt.stored_files(path, prefix)) or "none"
        raise fmt.damaged(path, f"{path} lacks the {prefix} tensors of {len(missing)} parameters this model needs, "
                                f"e.g. {missing[:3]} (its {prefix} files: {files})")


def _load_optimizer(path: str, chunks, optimizer, metadata: dict, state) -> None:
    index = fmt.tensor_index(path, "optim")
    params = {name: info for chunk in chunks for name, info in chunk.sharding().items()}
    stored = fmt.read_tensors(index, [k for k in index if k.split("/")[0] in params])
    per_param: dict[str, dict] = {}
    for key, full in stored.items():
        name, field = key.split("/", 1)
        per_param.setdefault(name, {})[field] = shard_full(full, params[name], state.tp_rank, state.tp_size)
    _refuse_missing(path, "optim", sorted(set(params) - set(per_param)))
    optimizer.load_state_dict_from_checkpoint({"params": per_param, **metadata["optimizer"]})
