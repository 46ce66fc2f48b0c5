"""The native checkpoint format in one place: file names, metadata, the tensor files and atomic publication.

    <root>/latest                  {"step": N, "dir": "step_0000000N"}, replaced last
    <root>/step_0000000N/
        metadata.json              version, step, data position, LR schedule, loss scaler, layout, config
        .metadata                  DCP's index: every tensor's full shape, and each stored rectangle's offsets
        __<rank>_0.distcp          the rectangles one rank wrote (``tensors``): "model/<param>" in the weights'
                                   dtype, "optim/<param>/master|exp_avg|exp_avg_sq" in fp32
        rng/rank00000.pt           each rank's RNG streams (restored only at the same layout)

Tensors are stored at their full shape under layout-free names, so any (tp, pp, dp, virtual pp, ZeRO stage)
loads any checkpoint, reading only the rectangles it needs (``tensors``). Training (``training/checkpoint.py``)
writes it from every rank; the offline converter (``convert/``) from one process. Both take the format from
here, so the two cannot drift apart, and the converter needs nothing of the trainer. A step is written into
``.tmp-step_*``, fsynced, renamed into place, and ``latest`` is replaced last: a crash at any moment leaves
``latest`` naming a whole checkpoint.

Reading refuses anything damaged with a ``CheckpointError`` naming the file: metadata that breaks its schema
(types, non-negative counts, a step equal to its folder's), unreadable JSON, a damaged index, a missing or
truncated shard file. A damaged step or ``latest`` names the intact steps beside it that can be loaded
instead, so nothing ever loads silently wrong and no one is left guessing what is still good. A version-1
checkpoint (full-size tensors per pipeline stage in safetensors) is refused with the commit whose converter
upgrades it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import fields

from ..config.errors import CheckpointError
from ..config.loader import config_from_dict
from ..config.schema import ARCHITECTURE_KEYS
from ..files import atomic_open, fsync_dir, publish
from ..models.counters import count_parameters
from ..models.full_state import stored_shapes
from . import tensors

VERSION = 2
LATEST = "latest"
METADATA = "metadata.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rng_file(rank: int) -> str:
    """A rank's RNG state, relative to the step directory."""
    return os.path.join("rng", f"rank{rank:05d}.pt")


def layout(tp: int, pp: int, dp: int | None, virtual_pp: int, zero_stage: int | None, cp: int = 1) -> dict:
    """The layout a checkpoint was saved at (None: not tied to one, as after an offline conversion)."""
    return {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "virtual_pp": virtual_pp, "zero_stage": zero_stage}


def metadata(step: int, config: dict, layout: dict, *, consumed_samples: int = 0, lr_schedule: dict | None = None,
             optimizer: dict | None = None) -> dict:
    """metadata.json's content. Without ``optimizer`` it describes weights only: a run loading it starts the
    optimizer fresh."""
    return {"version": VERSION, "step": step, "consumed_samples": consumed_samples,
            "has_optimizer": optimizer is not None, "lr_schedule": lr_schedule, "optimizer": optimizer,
            "layout": layout, "config": config}


TMP_PREFIX = ".tmp-"


def tmp_step_dir(root: str, step: int, run_id: str = "") -> str:
    """Where step ``step`` is written before ``publish_step_dir`` renames it to its step_* name. ``run_id``
    makes it unique per run, so that a run never deletes or fills another's."""
    return os.path.join(root, TMP_PREFIX + step_dir_name(step) + (f"-{run_id}" if run_id else ""))


def start_step_dir(root: str, step: int, run_id: str = "") -> str:
    """A fresh, empty ``tmp_step_dir`` (an older one left by a crash is removed)."""
    if os.path.isfile(root):
        raise FileExistsError(f"checkpoint root {root!r} is a file. Fix: give a directory path")
    tmp = tmp_step_dir(root, step, run_id)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def _write_json_atomic(path: str, payload) -> None:
    with atomic_open(path, encoding="utf-8") as f:
        json.dump(payload, f, indent=1)


def publish_step_dir(root: str, tmp: str, meta: dict, keep: int = 0) -> str:
    """Write metadata.json into ``tmp``, fsync, rename it to its step_* name, then point ``latest`` at it.

    Until the final replace of ``latest``, a reader still sees the previous whole checkpoint. ``keep`` > 0
    then removes all but the newest ``keep`` step directories.
    """
    _write_json_atomic(os.path.join(tmp, METADATA), meta)
    fsync_dir(tmp)
    final = os.path.join(root, step_dir_name(meta["step"]))
    shutil.rmtree(final, ignore_errors=True)
    publish(tmp, final)
    _write_json_atomic(os.path.join(root, LATEST), {"step": meta["step"], "dir": step_dir_name(meta["step"])})
    _prune(root, keep)
    return final


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
    try:
        with open(pointer, encoding="utf-8") as f:
            name = json.load(f)["dir"]
        if not isinstance(name, str) or not re.fullmatch(r"step_\d+", name):
            raise ValueError(f"'dir' is {name!r}, not a step_* name")
    except (OSError, ValueError, KeyError, TypeError) as problem:
        raise damaged(pointer, f"{pointer} is unreadable ({type(problem).__name__}: {problem})") from problem
    path = os.path.join(checkpoint_dir, name)
    if not os.path.isdir(path):
        raise damaged(pointer, f"{pointer} names {name}, which does not exist")
    return path


_COUNT = "a non-negative integer"
_RULES = {"an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          _COUNT: lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
          "true or false": lambda v: isinstance(v, bool),
          "an object": lambda v: isinstance(v, dict),
          "an object or null": lambda v: v is None or isinstance(v, dict)}
_FIELDS = {"version": "an integer", "step": _COUNT, "consumed_samples": _COUNT, "has_optimizer": "true or false",
           "lr_schedule": "an object or null", "optimizer": "an object or null", "layout": "an object",
           "config": "an object"}


def _schema_problems(meta, step_dir: str) -> list[str]:
    """What in ``meta`` breaks metadata.json's schema, one phrase each (none: valid)."""
    if not isinstance(meta, dict):
        return ["it is not a JSON object"]
    problems = [f"'{k}' is missing" if k not in meta else f"{k} = {meta[k]!r} is not {rule}"
                for k, rule in _FIELDS.items() if k not in meta or not _RULES[rule](meta[k])]
    if problems:
        return problems
    if meta["has_optimizer"] and (meta["optimizer"] is None or meta["lr_schedule"] is None):
        problems.append("has_optimizer is true but 'optimizer' or 'lr_schedule' is null")
    if not isinstance(meta["config"].get("model"), dict):
        problems.append("config.model is not an object")
    problems += [f"layout.{k} = {meta['layout'].get(k)!r} is not a positive integer" for k in ("tp", "cp", "pp")
                 if not (_RULES[_COUNT](meta["layout"].get(k)) and meta["layout"][k] > 0)]
    folder = re.fullmatch(r"step_(\d+)", os.path.basename(os.path.normpath(step_dir)))
    if folder and int(folder.group(1)) != meta["step"]:
        problems.append(f"step = {meta['step']} differs from its folder's step {int(folder.group(1))}")
    return problems


def _read_metadata(path: str) -> dict:
    """metadata.json of the step directory ``path``, validated; ValueError/OSError say what is wrong."""
    meta_path = os.path.join(path, METADATA)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{path} has no {METADATA} (checkpoint.load takes a step_* directory or a "
                                f"checkpoint root with a '{LATEST}' file)")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except ValueError as problem:
        raise ValueError(f"{meta_path} is not valid JSON ({problem})") from problem
    if isinstance(meta, dict) and meta.get("version") == 1:
        raise CheckpointError(f"{path} is a version-1 checkpoint (full-size tensors in model-pp*.safetensors), "
                              f"which this release no longer reads. Fix: upgrade it with the converter of commit "
                              f"7c22769 (git worktree add ../md-7c22769 7c22769; python ../md-7c22769/tools/"
                              f"convert_checkpoint.py upgrade --input {path} --output NEW_DIR), then load NEW_DIR")
    if isinstance(meta, dict) and meta.get("version") != VERSION:
        raise ValueError(f"{meta_path}: format version {meta.get('version')!r} is not {VERSION}")
    problems = _schema_problems(meta, path)
    if problems:
        raise ValueError(f"{meta_path} is damaged: " + "; ".join(problems))
    return meta


def read_metadata(path: str) -> dict:
    """The validated metadata of step directory ``path``, or a CheckpointError naming the file and what to load
    instead."""
    try:
        return _read_metadata(path)
    except CheckpointError:
        raise
    except (OSError, ValueError) as problem:
        raise damaged(path, str(problem)) from problem


def file_problems(step_dir: str) -> list[str]:
    """What is wrong with the tensor files of ``step_dir``: a missing or damaged index, or shard files it
    names that are missing or truncated (none: all there)."""
    try:
        index = tensors.read_index(step_dir)
    except CheckpointError as problem:
        return [str(problem)]
    return tensors.damaged_shards(step_dir, index)


def check_files(step_dir: str) -> None:
    """Refuse a step directory whose tensor files are incomplete, naming them and the intact steps beside it."""
    problems = file_problems(step_dir)
    if problems:
        raise damaged(step_dir, "; ".join(problems))


def intact_steps(root: str) -> list[str]:
    """The step_* directories under ``root`` whose metadata validates and whose stage files are all there, oldest
    first (the tensors are not read: this is what to suggest, not a guarantee)."""
    intact = []
    for name in sorted(d for d in os.listdir(root) if d.startswith("step_")) if os.path.isdir(root) else []:
        try:
            _read_metadata(os.path.join(root, name))
            if not file_problems(os.path.join(root, name)):
                intact.append(name)
        except (OSError, ValueError, CheckpointError):
            pass
    return intact


def damaged(entry: str, problem: str) -> CheckpointError:
    """The error for an unusable ``entry`` of a checkpoint root (a step directory, or ``latest``): the problem,
    then the intact steps beside it that can be loaded instead."""
    root, own = os.path.split(os.path.normpath(entry))
    others = [s for s in intact_steps(root) if s != own]
    if others:
        fix = (f"load an intact checkpoint instead, e.g. the newest: checkpoint.load={os.path.join(root, others[-1])} "
               f"(intact in {root}: {', '.join(others)})")
    else:
        fix = "start from another checkpoint (no intact step_* folder beside it), or re-create this one"
    return CheckpointError(f"checkpoint {problem}. Fix: {fix}")


def check_compatible(meta: dict, model_cfg) -> None:
    """Refuse a checkpoint of a different model: one whose stored tensors (names and full shapes, derived from
    both configs' models, so no setting can be forgotten) or whose layer kinds (``ARCHITECTURE_KEYS``) differ,
    naming every model setting that differs."""
    saved = config_from_dict({"model": meta["config"]["model"]}).model
    kinds = [key for key in ARCHITECTURE_KEYS if getattr(saved, key) != getattr(model_cfg, key)]
    if not kinds and stored_shapes(saved) == stored_shapes(model_cfg):
        return
    differing = [f"model.{f.name}: checkpoint {getattr(saved, f.name)!r} vs config {getattr(model_cfg, f.name)!r}"
                 for f in fields(model_cfg) if getattr(saved, f.name) != getattr(model_cfg, f.name)]
    raise CheckpointError("checkpoint is from an incompatible model (its tensors' shapes or layer kinds differ); "
                          "differing keys:\n  " + "\n  ".join(differing)
                          + "\nFix: load it with the model settings it was saved with.")


def estimated_bytes(cfg) -> int:
    """One checkpoint's size, estimated before it exists: each parameter in its training dtype plus 12 bytes
    of fp32 optimizer state (the master copy and Adam's two moments; an upper bound for SGD)."""
    param_bytes = 2 if cfg.train.bf16 or cfg.train.fp16 else 4
    return count_parameters(cfg.model) * (param_bytes + 12)
