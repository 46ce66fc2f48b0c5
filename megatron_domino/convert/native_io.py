"""The native checkpoint format (``checkpoint_format``), offline: reading and writing it one tensor at a time.

The converter runs in one process. It reads a checkpoint's weights one full tensor at a time
(``NativeTensors``), and writes them one at a time, each produced only when the writer reaches it
(``write_native``), so neither direction ever holds the whole model. The tensors are
layout-free, so the target layout lives only in the metadata and config. Written tensors are cut into row
blocks, so that a rank loading its slice of, say, a 2 GB embedding reads a block, not the whole of it.
"""
from __future__ import annotations

import math
import os

import torch

from .. import checkpoint_format as fmt
from ..checkpoint_format import tensors
from ..config import Config, ConfigError, config_from_dict, config_to_dict
from ..validation import validate_config
from .hf_io import TensorView

MODEL = "model/"  # stored names of the weights; the optimizer's are under "optim/"


def check_layout(cfg: Config) -> None:
    """Every rule a run at world size tp * pp (times ep: its ranks come from dp) checks, except those on data
    (given when the run starts)."""
    par = cfg.parallel
    try:
        validate_config(cfg, world_size=par.tp * par.pp * par.ep, check_paths=False)
    except ConfigError as error:
        problems = [p for p in error.problems if not p.key.startswith("data.")]
        if problems:
            raise ConfigError.of(problems) from None


def layout(cfg: Config) -> dict:
    """The layout of a converted checkpoint: tp, pp and virtual pp; any dp, ep and ZeRO stage may load it."""
    par = cfg.parallel
    return fmt.layout(par.tp, par.pp, None, par.virtual_pp, None)


def open_native(path: str) -> tuple[str, dict, Config]:
    """(step directory, metadata, Config) of a checkpoint root (follows ``latest``) or a step directory."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--input {path!r} is not a directory. Fix: give a checkpoint root (with a "
                                f"'latest' file) or one of its step_* directories")
    step_dir = fmt.resolve_load_path(path, None)
    metadata = fmt.read_metadata(step_dir)
    fmt.check_files(step_dir)
    return step_dir, metadata, config_from_dict(metadata["config"])


class NativeTensors:
    """The stored tensors under ``prefix`` of a step directory, by their names without it; each read whole,
    one at a time, only when asked for (the interface of ``hf_io.TensorFiles``)."""

    def __init__(self, step_dir: str, prefix: str = MODEL):
        self.step_dir, self.prefix = step_dir, prefix
        self.reader = tensors.SafeReader(step_dir)
        stored = tensors.stored_tensors(self.reader.read_metadata())
        self._specs = {name[len(prefix):]: spec for name, spec in stored.items() if name.startswith(prefix)}
        self.read: set[str] = set()

    def keys(self) -> list[str]:
        return list(self._specs)

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def spec(self, name: str):
        if name not in self._specs:
            raise KeyError(f"tensor {name!r} is not in {self.step_dir}. Fix: the checkpoint does not match its "
                           f"metadata.json (layer count, tied or untied head)")
        return self._specs[name]

    def get(self, name: str):
        self.spec(name)
        self.read.add(name)
        return tensors.read_full(self.step_dir, self.prefix + name, self.reader)

    def view(self, meta: bool = False) -> TensorView:
        return TensorView(self, meta)


BLOCK_BYTES = 64 * 2**20  # stored rectangles of at most this size: a rank reads little beyond what it needs


def _row_blocks(dtype, shape) -> list[tuple[int, int]]:
    """(first row, rows) of the blocks a tensor of at least one dimension is stored in."""
    row_bytes = max(1, torch.empty((), dtype=dtype).element_size() * math.prod(shape[1:]))
    rows = max(1, BLOCK_BYTES // row_bytes)
    return [(start, min(rows, shape[0] - start)) for start in range(0, shape[0], rows)]


class _LastTensor:
    """Serves the blocks of one tensor at a time from a single ``fetch`` of it (blocks are written in order)."""

    def __init__(self, fetch):
        self.fetch, self.name, self.tensor = fetch, None, None

    def block(self, name: str, start: int, rows: int) -> torch.Tensor:
        if name != self.name:
            self.name, self.tensor = name, self.fetch(name)
        return self.tensor.narrow(0, start, rows) if self.tensor.dim() else self.tensor


def write_native(step_dir: str, specs: dict, fetch) -> None:
    """Write every tensor of ``specs`` (stored name -> (dtype, shape), in the order to write them) in row
    blocks of at most ``BLOCK_BYTES``, its data ``fetch(name)`` called only when the writer reaches it."""
    last = _LastTensor(fetch)
    state = {}
    for name, (dtype, shape) in specs.items():
        shape = tuple(shape)
        pieces = [tensors.Piece((start,) + (0,) * (len(shape) - 1), (rows,) + shape[1:],
                                lambda name=name, start=start, rows=rows: last.block(name, start, rows))
                  for start, rows in _row_blocks(dtype, shape)] if shape else \
            [tensors.Piece((), (), lambda name=name: last.block(name, 0, 0))]
        state[name] = tensors.Stored(shape, dtype, pieces)
    tensors.write(step_dir, state)


def model_only_metadata(cfg: Config) -> dict:
    """metadata.json of a checkpoint that holds weights only: a run loading it starts at step 0, optimizer fresh."""
    return fmt.metadata(0, config_to_dict(cfg), layout(cfg))
