"""Safetensors files read and written one tensor at a time, and HF's (sharded) checkpoint layout.

A 70B model does not fit twice in host memory, so nothing here builds a whole state dict:
``TensorFiles`` reads single tensors lazily from any number of files (a sharded HF checkpoint, or
a native checkpoint's per-stage files), and ``SafetensorsWriter`` writes the header from the
planned shapes first, then each tensor's bytes as it is produced.
"""
from __future__ import annotations

import json
import os
import re
import struct

import torch
from safetensors import safe_open

from ..files import atomic_open, publish, temporary_beside

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def nbytes(dtype: torch.dtype, shape) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * torch.empty((), dtype=dtype).element_size()


def parse_size(text) -> int:
    """'5GB' (10^9, as HF counts), '500MiB', '2KB' or a plain number of bytes -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"--max-shard-size = {text!r}: not a size. Fix: write e.g. 5GB, 500MB, 2GiB or a byte count")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


class TensorFiles:
    """name -> tensor over a set of safetensors files, read one tensor at a time.

    ``rename`` maps a stored key to the name callers use (old GPT-2 files lack the 'transformer.' prefix).
    """

    def __init__(self, files: list[str], rename=None):
        if not files:
            raise FileNotFoundError("no safetensors files given")
        self._handles, self._where = {}, {}
        self.read: set[str] = set()  # names fetched so far, to report tensors a conversion never used
        for path in files:
            handle = safe_open(path, framework="pt")
            self._handles[path] = handle
            for key in handle.keys():
                self._where[rename(key) if rename else key] = (path, key)

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def spec(self, name: str) -> tuple[torch.dtype, tuple]:
        """(dtype, shape) without reading the data."""
        path, key = self._lookup(name)
        piece = self._handles[path].get_slice(key)
        return DTYPES[piece.get_dtype()], tuple(piece.get_shape())

    def get(self, name: str) -> torch.Tensor:
        path, key = self._lookup(name)
        self.read.add(name)
        return self._handles[path].get_tensor(key)

    def _lookup(self, name: str):
        if name not in self._where:
            files = sorted({os.path.basename(p) for p in self._handles})
            raise KeyError(f"tensor {name!r} is in none of {files}. Fix: the checkpoint does not match its "
                           f"config.json (model type, layer count, tied or untied head); check both")
        return self._where[name]

    def view(self, meta: bool = False) -> "TensorView":
        return TensorView(self, meta)


class TensorView:
    """A read-only mapping over ``TensorFiles``; with ``meta`` it yields shape-only tensors, to plan outputs."""

    def __init__(self, files: TensorFiles, meta: bool):
        self.files, self.meta = files, meta

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.meta:
            dtype, shape = self.files.spec(name)
            return torch.empty(shape, dtype=dtype, device="meta")
        return self.files.get(name)


class SafetensorsWriter:
    """Writes one safetensors file whose tensors (names, dtypes, shapes, order) are known in advance.

    The header goes first, so each tensor can be written as soon as it exists and then dropped.
    """

    def __init__(self, path: str, specs: dict, metadata: dict | None = None):
        self.path, self.specs, self._order = path, specs, list(specs)
        header, offset = {}, 0
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        for name, (dtype, shape) in specs.items():
            size = nbytes(dtype, shape)
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # keep the data 8-byte aligned
        self._tmp = temporary_beside(path)  # published whole at ``close``
        self._file = open(self._tmp, "wb")
        self._file.write(struct.pack("<Q", len(text)) + text)
        self.bytes_written = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._order[0] if self._order else None
        dtype, shape = self.specs.get(name, (None, None))
        if name != expected or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise RuntimeError(f"{self.path}: got {name} {tensor.dtype} {tuple(tensor.shape)}, planned {expected} "
                               f"{dtype} {shape}; the conversion plan and the data disagree (a bug)")
        self._order.pop(0)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self.bytes_written += data.nbytes

    @property
    def done(self) -> bool:
        return not self._order

    def close(self) -> None:
        if self._order:
            self._file.close()
            os.remove(self._tmp)
            raise RuntimeError(f"{self.path}: {len(self._order)} planned tensors never written, e.g. {self._order[0]}")
        self._file.close()
        publish(self._tmp, self.path)


def open_hf_checkpoint(hf_dir: str, model_type: str) -> TensorFiles:
    """The weights of an HF directory: a sharded checkpoint (index json) or one model.safetensors."""
    index_path, single = os.path.join(hf_dir, INDEX_FILE), os.path.join(hf_dir, SINGLE_FILE)
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(hf_dir, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise FileNotFoundError(f"{index_path} names {missing[0]}, which does not exist. Fix: download every "
                                    f"shard listed in the index")
    elif os.path.exists(single):
        files = [single]
    else:
        found = sorted(os.listdir(hf_dir))[:10]
        raise FileNotFoundError(f"{hf_dir}: no {SINGLE_FILE} or {INDEX_FILE} (found {found}). Fix: only "
                                "safetensors weights are read; re-save the model with transformers' "
                                "save_pretrained(safe_serialization=True)")
    if model_type == "gpt2":  # checkpoints saved from GPT2Model name 'h.0...' instead of 'transformer.h.0...'
        return TensorFiles(files, _gpt2_prefixed)
    return TensorFiles(files)


def _gpt2_prefixed(key: str) -> str:
    return key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key


def shard_names(count: int) -> list[str]:
    """HF's file names: model.safetensors alone, else model-00001-of-0000N.safetensors."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def plan_shards(specs: dict, max_bytes: int) -> list[list[str]]:
    """Split names (in order) into runs of at most ``max_bytes`` each; a larger tensor gets a shard alone."""
    shards, size = [[]], 0
    for name, (dtype, shape) in specs.items():
        n = nbytes(dtype, shape)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_hf_index(hf_dir: str, weight_map: dict, total_size: int) -> None:
    with atomic_open(os.path.join(hf_dir, INDEX_FILE), encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")
