"""The native checkpoint format (``checkpoint_format``), offline: which stage file a tensor goes to, and opening.

Since the loader indexes every file, the split by pipeline stage only keeps files small and per-rank
reads local; it is redone here from the target layout's partition.
"""
from __future__ import annotations

import os

from .. import checkpoint_format as fmt
from ..config import Config, ConfigError, config_from_dict, config_to_dict, validate_config
from ..pipeline.stages import layer_partition
from .hf_io import TensorFiles
from .hf_mapping import POST, PRE, group_of


def stage_files(cfg: Config, prefix: str) -> dict:
    """group (PRE, a layer index, POST) -> the file its tensors go to, e.g. 'model-pp001.safetensors'."""
    pp = cfg.parallel.pp
    files = {PRE: fmt.stage_file(prefix, 0), POST: fmt.stage_file(prefix, pp - 1)}
    for stage, layers in enumerate(layer_partition(cfg)):
        for layer in layers:
            files[layer] = fmt.stage_file(prefix, stage % pp)
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
    """The layout of a converted checkpoint: tp, pp and virtual pp; any dp and ZeRO stage may load it."""
    par = cfg.parallel
    return fmt.layout(par.tp, par.pp, None, par.virtual_pp, None)


def open_native(path: str) -> tuple[str, dict, Config]:
    """(step directory, metadata, Config) of a checkpoint root (follows ``latest``) or a step directory."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--input {path!r} is not a directory. Fix: give a checkpoint root (with a "
                                f"'latest' file) or one of its step_* directories")
    step_dir = fmt.resolve_load_path(path, None)
    metadata = fmt.read_metadata(step_dir)
    return step_dir, metadata, config_from_dict(metadata["config"])


def native_tensors(step_dir: str, prefix: str) -> TensorFiles | None:
    """Every '<prefix>-*.safetensors' tensor of a step directory (None when there are no such files)."""
    files = fmt.stored_files(step_dir, prefix)
    return TensorFiles(files) if files else None


def model_only_metadata(cfg: Config) -> dict:
    """metadata.json of a checkpoint that holds weights only: a run loading it starts at step 0, optimizer fresh."""
    return fmt.metadata(0, config_to_dict(cfg), layout(cfg))
