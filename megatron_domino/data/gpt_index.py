"""The three index arrays of the GPT dataset, and the train/valid/test split of documents.

* document index: the split's documents, a fresh permutation per epoch, epochs back to back;
* sample index: where each sample starts, as (position in the document index, token offset). Sample ``i``
  covers tokens ``[i*L, i*L + L]`` of that concatenated stream (L + 1 tokens: inputs plus the shifted
  labels), so consecutive samples share one boundary token and no token is skipped;
* shuffle index: the order samples are served in, a permutation within each epoch (a sample belongs to
  the epoch of its last token), epochs in order, so all of epoch e is seen before epoch e + 1 starts.

Every permutation draws from its own generator seeded by (seed, epoch, purpose), so asking for more
samples later extends the order without changing the samples already served.
"""
from __future__ import annotations

import numpy as np

from megatron_domino.config.errors import DataError

_DOCUMENT_STREAM, _SAMPLE_STREAM = 0, 1


def parse_split(split: str) -> list[float]:
    """'949,50,1' (or '0.9, 0.1' / '98/2/0') as three normalised shares for train, valid, test."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"data.split={split!r} must be up to three non-negative numbers with a positive sum, "
                         f"e.g. '949,50,1' for train/valid/test")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_ranges(shares: list[float], num_documents: int) -> list[tuple[int, int]]:
    """Contiguous document ranges for train, valid, test. Cumulative shares are rounded, so the ranges always
    cover every document exactly once and a zero share always gets an empty range."""
    bounds = [0] + [int(round(c * num_documents)) for c in np.cumsum(shares)]
    bounds[-1] = num_documents
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def samples_in(tokens: int, seq_length: int) -> int:
    """Samples of ``seq_length + 1`` tokens that ``tokens`` packed tokens hold (neighbours share one token)."""
    return max(0, (tokens - 1) // seq_length)


def epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose token stream holds ``num_samples`` samples of ``seq_length + 1`` tokens."""
    if tokens_per_epoch <= 0:
        raise DataError("a dataset split has no tokens; lower the share of the other splits in data.split or add data")
    # samples available from T tokens: (T - 1) // L
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, seed: int) -> np.ndarray:
    """The split's document ids, reshuffled independently for each epoch."""
    dtype = np.int32 if len(documents) == 0 or documents.max() < 2**31 else np.int64
    epochs = [np.random.default_rng([seed, epoch, _DOCUMENT_STREAM]).permutation(documents).astype(dtype)
              for epoch in range(num_epochs)]
    return np.concatenate(epochs)


def build_sample_index(lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """Sample starts [num_samples + 1, 2] for documents of ``lengths`` tokens in document-index order.

    Row i is (k, o): sample i begins at token o of the k-th entry of the document index; row i + 1 marks
    where it ends (inclusive), since samples overlap by one token.
    """
    ends = np.cumsum(lengths, dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    num_samples = samples_in(total, seq_length)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    entry = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[entry] - np.asarray(lengths, dtype=np.int64)[entry])
    dtype = np.int32 if len(lengths) < 2**31 and (len(lengths) == 0 or int(np.max(lengths)) < 2**31) else np.int64
    return np.stack([entry, offset], axis=1).astype(dtype)


def build_shuffle_index(num_samples: int, tokens_per_epoch: int, seq_length: int, seed: int) -> np.ndarray:
    """Serving order: samples grouped by the epoch their last token lies in, shuffled within each group.

    Grouping by the last token makes every group but the final one independent of how many epochs were
    built, so a longer run serves the same samples first.
    """
    epoch_of_end = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length // tokens_per_epoch
    bounds = np.searchsorted(epoch_of_end, np.arange(int(epoch_of_end[-1]) + 2 if num_samples else 1))
    dtype = np.uint32 if num_samples < 2**32 else np.int64
    groups = [np.random.default_rng([seed, epoch, _SAMPLE_STREAM]).permutation(
        np.arange(bounds[epoch], bounds[epoch + 1], dtype=np.int64)) for epoch in range(len(bounds) - 1)]
    return np.concatenate(groups).astype(dtype) if groups else np.zeros(0, dtype)
