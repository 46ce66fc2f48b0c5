"""On-disk cache of dataset indices, keyed by a hash of everything that determines them.

Index building (shuffles, sample boundaries, blending choices) is deterministic but can take seconds to
minutes on large corpora, so one rank builds it, writes .npy files atomically, and every rank memory-maps
the same files. The description that was hashed is stored beside the arrays so a cache entry can be read
by a person.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Callable

import numpy as np

from ..files import atomic_open

Builder = Callable[[], dict]


def cache_dir_for(prefix: str, configured: str | None) -> str:
    """``configured`` (data.cache_dir) when set, else ``<prefix>_cache`` beside the data; a temp dir when that
    cannot be written (read-only datasets)."""
    wanted = configured or prefix + "_cache"
    if _writable(wanted):
        return wanted
    fallback = os.path.join(tempfile.gettempdir(), "megatron_domino_index_cache")
    os.makedirs(fallback, exist_ok=True)
    return fallback


def _writable(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


def description_key(description: dict) -> str:
    return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()


def load_or_build(cache_dir: str, description: dict, names: tuple[str, ...], build: Builder,
                  build_on_this_rank: bool = True, barrier: Callable[[], None] | None = None) -> dict:
    """The arrays ``names`` for ``description``: built by ``build()`` on the builder rank when missing, then
    shared through ``cache_dir``. All ranks call ``barrier`` (when given) between building and loading.

    A rank that finds no cache after the barrier (no barrier given, or a cache dir that is not shared)
    builds the same deterministic arrays itself rather than failing.
    """
    key = description_key(description)
    paths = {name: os.path.join(cache_dir, f"{key}-{name}.npy") for name in names}
    marker = os.path.join(cache_dir, f"{key}-description.json")
    if build_on_this_rank and not os.path.exists(marker):
        _save(build(), paths, marker, description)
    if barrier is not None:
        barrier()
    if not os.path.exists(marker):
        _save(build(), paths, marker, description)
    return {name: np.load(path, mmap_mode="r", allow_pickle=False) for name, path in paths.items()}


def _save(arrays: dict, paths: dict, marker: str, description: dict) -> None:
    """Each array to a temp name then renamed; the description marker last, so its presence means complete."""
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    for name, path in paths.items():
        with atomic_open(path, "wb") as f:
            np.save(f, arrays[name], allow_pickle=False)
    with atomic_open(marker, "wb") as f:
        f.write(json.dumps(description, indent=2, sort_keys=True).encode())
