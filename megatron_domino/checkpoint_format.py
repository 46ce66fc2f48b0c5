"""The native checkpoint format in one place: file names, metadata, the tensor index and atomic publication.

    <root>/latest                  {"step": N, "dir": "step_0000000N"}, replaced last
    <root>/step_0000000N/
        metadata.json              version, step, data position, LR schedule, loss scaler, layout, config
        model-pp000.safetensors    full-size parameters of pipeline rank 0's chunks (global names)
        optim-pp000.safetensors    full-size fp32 optimizer state: "<param>/master", "<param>/exp_avg", ...
        rng/rank00000.pt           each rank's RNG streams (restored only at the same layout)

Training (``training/checkpoint.py``) writes and reads it across ranks; the offline converter (``convert/``)
writes it from one process. Both take the format from here, so the two cannot drift apart, and the converter
needs nothing of the trainer. A step is written into ``.tmp-step_*``, fsynced, renamed into place, and
``latest`` is replaced last: a crash at any moment leaves ``latest`` naming a whole checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil

from safetensors import safe_open

from .config.loader import config_from_dict

VERSION = 1
LATEST = "latest"
METADATA = "metadata.json"
# Model settings that change tensor shapes or the function computed; a checkpoint must agree on them.
SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_size", "num_attention_heads", "query_groups", "head_dim",
              "vocab_size", "position_embedding", "norm", "activation", "bias", "tie_embeddings", "max_positions")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def stage_file(prefix: str, pp_rank: int) -> str:
    """'model-pp001.safetensors': the tensors ``prefix`` ('model' or 'optim') of pipeline rank ``pp_rank``."""
    return f"{prefix}-pp{pp_rank:03d}.safetensors"


def rng_file(rank: int) -> str:
    """A rank's RNG state, relative to the step directory."""
    return os.path.join("rng", f"rank{rank:05d}.pt")


def layout(tp: int, pp: int, dp: int | None, virtual_pp: int, zero_stage: int | None) -> dict:
    """The layout a checkpoint was saved at (None: not tied to one, as after an offline conversion)."""
    return {"tp": tp, "pp": pp, "dp": dp, "virtual_pp": virtual_pp, "zero_stage": zero_stage}


def metadata(step: int, config: dict, layout: dict, *, consumed_samples: int = 0, lr_schedule: dict | None = None,
             optimizer: dict | None = None) -> dict:
    """metadata.json's content. Without ``optimizer`` it describes weights only: a run loading it starts the
    optimizer fresh."""
    return {"version": VERSION, "step": step, "consumed_samples": consumed_samples,
            "has_optimizer": optimizer is not None, "lr_schedule": lr_schedule, "optimizer": optimizer,
            "layout": layout, "config": config}


def tmp_step_dir(root: str, step: int) -> str:
    """Where step ``step`` is written before ``publish_step_dir`` renames it to its step_* name."""
    return os.path.join(root, ".tmp-" + step_dir_name(step))


def start_step_dir(root: str, step: int) -> str:
    """A fresh, empty ``tmp_step_dir`` (an older one left by a crash is removed)."""
    if os.path.isfile(root):
        raise FileExistsError(f"checkpoint root {root!r} is a file. Fix: give a directory path")
    tmp = tmp_step_dir(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
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


def publish_step_dir(root: str, tmp: str, meta: dict, keep: int = 0) -> str:
    """Write metadata.json into ``tmp``, fsync, rename it to its step_* name, then point ``latest`` at it.

    Until the final replace of ``latest``, a reader still sees the previous whole checkpoint. ``keep`` > 0
    then removes all but the newest ``keep`` step directories.
    """
    _write_json_atomic(os.path.join(tmp, METADATA), meta)
    fsync_dir(tmp)
    final = os.path.join(root, step_dir_name(meta["step"]))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(root)
    _write_json_atomic(os.path.join(root, LATEST), {"step": meta["step"], "dir": step_dir_name(meta["step"])})
    fsync_dir(root)
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
    with open(pointer, encoding="utf-8") as f:
        return os.path.join(checkpoint_dir, json.load(f)["dir"])


def read_metadata(path: str) -> dict:
    meta_path = os.path.join(path, METADATA)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"checkpoint.load = {path!r}: no {METADATA} there. Fix: point it at a "
                                f"step_* directory or a checkpoint root with a '{LATEST}' file.")
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("version") != VERSION:
        raise ValueError(f"checkpoint {path}: format version {meta.get('version')} is not {VERSION}. Fix: "
                         f"convert it with the release that wrote it, or start from another checkpoint")
    return meta


def check_compatible(meta: dict, model_cfg) -> None:
    """Refuse a checkpoint of a different model, naming every differing key."""
    saved = config_from_dict({"model": meta["config"]["model"]}).model
    differing = [f"model.{k}: checkpoint {getattr(saved, k)!r} vs config {getattr(model_cfg, k)!r}"
                 for k in SHAPE_KEYS if getattr(saved, k) != getattr(model_cfg, k)]
    if differing:
        raise ValueError("checkpoint is from an incompatible model; differing keys:\n  " + "\n  ".join(differing)
                         + "\nFix: load it with the model settings it was saved with.")


def stored_files(step_dir: str, prefix: str) -> list[str]:
    """Paths of every '<prefix>-*.safetensors' of a step directory, sorted."""
    return sorted(os.path.join(step_dir, f) for f in os.listdir(step_dir)
                  if f.startswith(prefix + "-") and f.endswith(".safetensors"))


def tensor_index(step_dir: str, prefix: str) -> dict[str, str]:
    """name -> file for every tensor of '<prefix>-*.safetensors': any layout reads by name, whatever file holds it."""
    index = {}
    for file in stored_files(step_dir, prefix):
        with safe_open(file, framework="pt") as handle:
            index.update(dict.fromkeys(handle.keys(), file))
    return index


def read_tensors(index: dict[str, str], names) -> dict:
    """The tensors ``names`` that ``index`` holds (others are skipped), each file opened once."""
    by_file, out = {}, {}
    for name in names:
        if name in index:
            by_file.setdefault(index[name], []).append(name)
    for file, keys in by_file.items():
        with safe_open(file, framework="pt") as handle:
            for key in keys:
                out[key] = handle.get_tensor(key)
    return out
