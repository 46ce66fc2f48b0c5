"""The native checkpoint format, offline: which stage file a tensor goes to, metadata, and atomic placement.

The format itself is ``training/checkpoint.py``'s: a ``step_*`` directory with metadata.json and
``model-pp*.safetensors`` / ``optim-pp*.safetensors`` of full-size tensors under global names, and a
``latest`` pointer at the root. Since the loader indexes every file, the split by pipeline stage only
keeps files small and per-rank reads local; it is redone here from the target layout's partition.
"""
from __future__ import annotations

import os
import shutil

from ..config import Config, ConfigError, config_from_dict, config_to_dict, validate_config
from ..pipeline.stages import layer_partition
from ..training.checkpoint import VERSION, read_metadata, resolve_load_path, step_dir_name
from .hf_io import TensorFiles
from .hf_mapping import POST, PRE, group_of


def stage_files(cfg: Config, prefix: str) -> dict:
    """group (PRE, a layer index, POST) -> the file its tensors go to, e.g. 'model-pp001.safetensors'."""
    pp = cfg.parallel.pp
    files = {PRE: f"{prefix}-pp000.safetensors", POST: f"{prefix}-pp{pp - 1:03d}.safetensors"}
    for stage, layers in enumerate(layer_partition(cfg)):
        for layer in layers:
            files[layer] = f"{prefix}-pp{stage % pp:03d}.safetensors"
    return files


def file_of(name: str, files: dict) -> str:
    """The stage file of a model tensor ('layers.3.mlp.fc1.weight') or an optimizer one ('<param>/exp_avg')."""
    return files[group_of(name.split("/", 1)[0])]


def check_layout(cfg: Config) -> None:
    """Every rule a run at world size tp * pp checks, except those on data (given when the run starts)."""
    try:
        validate_config(cfg, world_size=cfg.parallel.tp * cfg.parallel.pp, check_paths=False)
    except ConfigError as error:
        problems = [p for p in error.problems if not p.key.startswith("data.")]
        if problems:
            raise ConfigError.of(problems) from None


def layout(cfg: Config) -> dict:
    par = cfg.parallel
    return {"tp": par.tp, "pp": par.pp, "dp": None, "virtual_pp": par.virtual_pp, "zero_stage": None}


def open_native(path: str) -> tuple[str, dict, Config]:
    """(step directory, metadata, Config) of a checkpoint root (follows ``latest``) or a step directory."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--input {path!r} is not a directory. Fix: give a checkpoint root (with a "
                                f"'latest' file) or one of its step_* directories")
    step_dir = resolve_load_path(path, None)
    metadata = read_metadata(step_dir)
    return step_dir, metadata, config_from_dict(metadata["config"])


def native_tensors(step_dir: str, prefix: str) -> TensorFiles | None:
    """Every '<prefix>-*.safetensors' tensor of a step directory (None when there are no such files)."""
    files = sorted(os.path.join(step_dir, f) for f in os.listdir(step_dir)
                   if f.startswith(prefix + "-") and f.endswith(".safetensors"))
    return TensorFiles(files) if files else None


def start_step_dir(root: str, step: int) -> str:
    """A fresh temporary directory beside the final ``step_*``; ``training.checkpoint.publish_step_dir`` moves it into place."""
    if os.path.isfile(root):
        raise FileExistsError(f"--output {root!r} is a file. Fix: give a directory path")
    tmp = os.path.join(root, ".tmp-" + step_dir_name(step))
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def model_only_metadata(cfg: Config) -> dict:
    """metadata.json of a checkpoint that holds weights only: a run loading it starts at step 0, optimizer fresh."""
    return {"version": VERSION, "step": 0, "consumed_samples": 0, "has_optimizer": False, "lr_schedule": None,
            "optimizer": None, "layout": layout(cfg), "config": config_to_dict(cfg)}
