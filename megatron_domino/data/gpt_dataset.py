"""GPT pretraining samples: documents packed end to end, cut into samples of seq_length + 1 tokens.

The document, sample and shuffle indices (``gpt_index.py``) are built once per set of parameters and cached
on disk (``index_cache.py``); ``ds[i]`` then reads one sample straight from the memory-mapped tokens.
Nothing depends on the parallel layout, so every layout sees the same sample ``i``.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from megatron_domino.config.errors import DataError

from . import gpt_index
from .index_cache import load_or_build
from .indexed_dataset import IndexedDataset
from .sample import attention_layout, make_sample

_INDEX_FORMAT = 1  # bump when the way indices are built changes, so stale caches are not reused


@dataclass(frozen=True)
class SampleOptions:
    """What turns packed tokens into a training sample (see ``sample.make_sample``)."""

    seq_length: int
    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    def make(self, tokens: np.ndarray) -> dict:
        return make_sample(tokens, self.eod, self.reset_position_ids, self.reset_attention_mask, self.eod_mask_loss)

    def layout(self, tokens: np.ndarray) -> dict:
        return attention_layout(tokens, self.eod, self.reset_attention_mask)


class PackedSamples(torch.utils.data.Dataset):
    """A dataset whose sample i is ``options`` applied to ``sample_tokens(i)`` (its L + 1 packed tokens)."""

    def __getitem__(self, i: int) -> dict:
        return self.options.make(self.sample_tokens(i))

    def attention_layout(self, i: int) -> dict:
        """Sample i's length and documents only, for balanced packing (``MicroBatchLoader``)."""
        return self.options.layout(self.sample_tokens(i))


class GPTDataset(PackedSamples):
    """At least ``num_samples`` samples from the documents ``[first_document, last_document)`` of ``indexed``.

    Its length is every sample of the epochs that were needed (so at least ``num_samples``).
    """

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: int,
                 options: SampleOptions, seed: int, cache_dir: str, split_name: str,
                 build_on_this_rank: bool = True, barrier: Callable[[], None] | None = None):
        self.indexed, self.options = indexed, options
        first, last = document_range
        if last <= first:
            raise DataError(f"the {split_name} split of {indexed.prefix} holds no documents (range {first}..{last} of "
                            f"{len(indexed)}). Fix: change data.split or add data")
        documents = np.arange(first, last, dtype=np.int64)
        tokens_per_epoch = int(indexed.sizes[first:last].sum(dtype=np.int64))
        description = {
            "kind": "GPTDataset", "format": _INDEX_FORMAT, "prefix": os.path.abspath(indexed.prefix),
            # the indices depend on the document lengths only, so those (not file dates) key the cache
            "sizes_md5": hashlib.md5(np.ascontiguousarray(indexed.sizes[first:last]).data).hexdigest(),
            "split": split_name, "documents": [first, last], "num_samples": int(num_samples),
            "seq_length": options.seq_length, "seed": int(seed),
        }

        def build() -> dict:
            epochs = gpt_index.epochs_needed(tokens_per_epoch, options.seq_length, num_samples)
            document_index = gpt_index.build_document_index(documents, epochs, seed)
            sample_index = gpt_index.build_sample_index(indexed.sizes[document_index], options.seq_length)
            shuffle_index = gpt_index.build_shuffle_index(len(sample_index) - 1, tokens_per_epoch,
                                                          options.seq_length, seed)
            return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}

        arrays = load_or_build(cache_dir, description, ("document_index", "sample_index", "shuffle_index"), build,
                               build_on_this_rank, barrier)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample_tokens(self, i: int) -> np.ndarray:
        """The L + 1 packed tokens of sample ``i`` (after shuffling)."""
        j = int(self.shuffle_index[i])
        first_entry, first_offset = (int(x) for x in self.sample_index[j])
        last_entry, last_offset = (int(x) for x in self.sample_index[j + 1])
        if first_entry == last_entry:
            doc = int(self.document_index[first_entry])
            return np.array(self.indexed.get(doc, first_offset, last_offset - first_offset + 1), dtype=np.int64)
        pieces = [self.indexed.get(int(self.document_index[first_entry]), first_offset)]
        pieces += [self.indexed.get(int(self.document_index[k])) for k in range(first_entry + 1, last_entry)]
        pieces.append(self.indexed.get(int(self.document_index[last_entry]), 0, last_offset + 1))
        return np.concatenate(pieces).astype(np.int64)

    def documents(self, i: int) -> list[str]:
        """The documents sample ``i`` packs, as ``PREFIX-NAME:DOCUMENT`` (for reports of a bad step)."""
        j = int(self.shuffle_index[i])
        first_entry, last_entry = int(self.sample_index[j][0]), int(self.sample_index[j + 1][0])
        name = os.path.basename(self.indexed.prefix)
        return [f"{name}:{int(self.document_index[k])}" for k in range(first_entry, last_entry + 1)]


class MockGPTDataset(PackedSamples):
    """Deterministic synthetic samples for tests and benchmarks: uniform random tokens below the EOD id, with an
    EOD (vocab_size - 1) at about one position in ``document_tokens`` (``data.mock_document_tokens``) so that the
    reset flags have documents to separate.

    Sample ``i`` depends only on (seed, split, i), never on the order of access or the parallel layout.
    """

    def __init__(self, num_samples: int, vocab_size: int, options: SampleOptions, seed: int, split_index: int,
                 document_tokens: int = 32):
        self.num_samples, self.vocab_size, self.options = int(num_samples), int(vocab_size), options
        self.seed, self.split_index, self.eod_rate = int(seed), int(split_index), 1.0 / document_tokens

    def __len__(self) -> int:
        return self.num_samples

    def sample_tokens(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} is outside the mock dataset of {self.num_samples}")
        rng = np.random.default_rng([self.seed, self.split_index, i])
        tokens = rng.integers(0, self.vocab_size - 1, self.options.seq_length + 1, dtype=np.int64)
        tokens[rng.random(len(tokens)) < self.eod_rate] = self.vocab_size - 1
        return tokens

    def documents(self, i: int) -> list[str]:
        return [f"mock:{self.split_index}:{i}"]
