"""Token ids outside the vocabulary are refused before step 1, naming the file, the document and the vocabulary.

The vocab-parallel embedding and cross entropy treat an id that no TP rank owns as a masked one (zero
embedding, no loss), so at tp > 1 such data would train silently; at tp = 1 it would train on a padding
row of the embedding or fail there with a bare IndexError. One pass over a dataset's tokens finds its smallest and largest id and where they lie.
The result is cached beside the indices (``index_cache``), keyed by the .bin's path, size and date (the
ids are its content), so the pass runs once per dataset, not once per run, split or vocabulary.
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

from megatron_domino.config.errors import DataError

from .index_cache import load_or_build
from .indexed_dataset import IndexedDataset, data_path

_FORMAT = 1  # bump when what is cached changes
_CHUNK_TOKENS = 1 << 26  # tokens per step of the pass: memory stays bounded however large the file


def token_extremes(indexed: IndexedDataset) -> np.ndarray:
    """[smallest id, its position, largest id, its position] over every token of ``indexed``, positions counted
    in tokens from the start of the .bin; all -1 when it holds no token."""
    tokens = indexed.tokens()
    found = np.full(4, -1, dtype=np.int64)
    for start in range(0, len(tokens), _CHUNK_TOKENS):
        chunk = tokens[start:start + _CHUNK_TOKENS]
        low, high = int(chunk.argmin()), int(chunk.argmax())
        if found[1] < 0 or chunk[low] < found[0]:
            found[0:2] = chunk[low], start + low
        if found[3] < 0 or chunk[high] > found[2]:
            found[2:4] = chunk[high], start + high
    return found


def check_token_ids(indexed: IndexedDataset, vocab_size: int, cache_dir: str, build_on_this_rank: bool = True,
                    barrier: Callable[[], None] | None = None) -> None:
    """Raise ``DataError`` when ``indexed`` holds an id outside ``[0, vocab_size)``. The pass runs where
    ``build_on_this_rank`` is True; every rank calls ``barrier`` (when given), then reads the cached result."""
    bin_file = data_path(indexed.prefix)
    stat = os.stat(bin_file)
    description = {"kind": "token extremes", "format": _FORMAT, "bin": os.path.abspath(bin_file),
                   "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    arrays = load_or_build(cache_dir, description, ("extremes",), lambda: {"extremes": token_extremes(indexed)},
                           build_on_this_rank, barrier)
    low, low_at, high, high_at = (int(x) for x in arrays["extremes"])
    if high_at < 0 or (low >= 0 and high < vocab_size):
        return
    value, position = (low, low_at) if low < 0 else (high, high_at)
    sequence = int(np.searchsorted(indexed.pointers, position * indexed.dtype.itemsize, side="right")) - 1
    document = int(np.searchsorted(indexed.document_indices, sequence, side="right")) - 1
    larger = f", or set model.vocab_size to the tokenizer's vocabulary (at least {value + 1})" if value > 0 else ""
    raise DataError(f"{bin_file}: document {document} (counting from 0) holds token id {value}, outside the "
                    f"vocabulary of model.vocab_size = {vocab_size} (ids 0..{vocab_size - 1}); at tp > 1 it would "
                    f"train silently as a masked token. Fix: preprocess the corpus with the model's tokenizer "
                    f"(tools/preprocess_data.py){larger}")
