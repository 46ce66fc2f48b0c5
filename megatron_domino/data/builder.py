"""From the run configuration to the train/valid/test datasets the trainer iterates.

``data.path`` is Megatron's list (parsed by ``config.data_path``): ``[PREFIX, ...]`` or ``[w1, PREFIX1, w2,
PREFIX2, ...]``. Every prefix is split into train/valid/test by ``data.split`` over its documents; with several
prefixes each split is a blend. Without weights, each prefix weighs what Megatron's ``BlendedMegatronDatasetBuilder``
gives it: its size, the number of samples one pass over its part of the split holds ((tokens - 1) // seq_length),
so every sample of every prefix is drawn about equally often. Megatron then caps the blend at one such pass; here
the blend holds the samples asked for, going round the prefixes again in the same proportions.
``data.mock`` replaces all of it with synthetic tokens.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Callable

import numpy as np

from megatron_domino.config.data_path import EXAMPLES, parse_data_path
from megatron_domino.config.errors import ConfigError
from megatron_domino.config.eval_sets import parse_eval_sets
from megatron_domino.config.schema import Config

from .blended_dataset import BlendedDataset, load_blending_indices
from .gpt_dataset import GPTDataset, MockGPTDataset, SampleOptions
from .gpt_index import parse_split, samples_in, split_ranges
from .index_cache import cache_dir_for
from .indexed_dataset import IndexedDataset
from .token_check import check_token_ids
from .tokenizer import build_tokenizer

SPLIT_NAMES = ("train", "valid", "test")


def _sample_options(cfg: Config, eod: int) -> SampleOptions:
    return SampleOptions(cfg.model.seq_length, eod, cfg.data.reset_position_ids, cfg.data.reset_attention_mask,
                         cfg.data.eod_mask_loss)


def _eod_token(cfg: Config) -> int:
    """EOD matters only to the reset/mask flags; the tokenizer files are read only when one of them is on."""
    if cfg.data.reset_position_ids or cfg.data.reset_attention_mask or cfg.data.eod_mask_loss:
        return build_tokenizer(cfg.tokenizer, cfg.model.vocab_size).eod
    return cfg.model.vocab_size - 1


def build_train_valid_test_datasets(cfg: Config, num_samples: tuple[int, int, int], build_on_this_rank: bool = True,
                                    barrier: Callable[[], None] | None = None) -> tuple:
    """(train, valid, test) holding at least ``num_samples`` samples each; None for a split whose share in
    ``data.split`` is 0 or that asks for no samples.

    Index building runs where ``build_on_this_rank`` is True; then every rank calls ``barrier()`` (when given)
    and loads the cached indices. With no barrier, each rank builds what it does not find. The barrier should
    wait over the store within ``data.index_build_timeout_s`` (the trainer passes its phase's store barrier):
    a building rank may outlast the collective timeout that would abort a ``dist.barrier()``.
    """
    shares = parse_split(cfg.data.split)
    wanted = [share > 0 and n > 0 for share, n in zip(shares, num_samples)]
    if num_samples[0] > 0 and not wanted[0]:
        raise ValueError(f"data.split={cfg.data.split!r} gives the train split no share but {num_samples[0]} training "
                         f"samples are needed; give train a positive share, e.g. '949,50,1'")
    if cfg.data.mock:
        options = _sample_options(cfg, cfg.model.vocab_size - 1)
        return tuple(MockGPTDataset(n, cfg.model.vocab_size, options, cfg.train.seed, s, cfg.data.mock_document_tokens)
                     if want else None for s, (n, want) in enumerate(zip(num_samples, wanted)))
    options = _sample_options(cfg, _eod_token(cfg))
    blend = parse_data_path(cfg.data.path)
    indexed = {prefix: IndexedDataset(prefix) for prefix in blend.prefixes}
    for prefix, dataset in indexed.items():  # ids beyond the vocabulary would train silently at tp > 1
        check_token_ids(dataset, cfg.model.vocab_size, cache_dir_for(prefix, cfg.data.cache_dir), build_on_this_rank,
                        barrier)
    result = []
    for s, name in enumerate(SPLIT_NAMES):
        if not wanted[s]:
            result.append(None)
            continue
        build = dict(options=options, seed=cfg.train.seed, build_on_this_rank=build_on_this_rank, barrier=barrier)
        if len(blend.prefixes) == 1:
            prefix = blend.prefixes[0]
            result.append(_gpt_dataset(indexed[prefix], shares, s, num_samples[s], cfg.data.cache_dir, **build))
            continue
        weights = blend.weights or _sizes(cfg, [indexed[p] for p in blend.prefixes], shares, s)
        description = {"prefixes": [os.path.abspath(p) for p in blend.prefixes], "split": name, "data_split": shares}
        choice, within = load_blending_indices(weights, num_samples[s],
                                               cache_dir_for(blend.prefixes[0], cfg.data.cache_dir), description,
                                               build_on_this_rank, barrier)
        counts = np.bincount(np.asarray(choice, dtype=np.int64), minlength=len(blend.prefixes))
        parts = [_gpt_dataset(indexed[prefix], shares, s, int(count), cfg.data.cache_dir, **build) if count else None
                 for prefix, count in zip(blend.prefixes, counts)]
        result.append(BlendedDataset(parts, choice, within))
    return tuple(result)


def _sizes(cfg: Config, datasets: list[IndexedDataset], shares: list[float], split: int) -> list[int]:
    """Blend weights of an unweighted ``data.path``: the samples one pass over each prefix's part of the split holds."""
    sizes = []
    for indexed in datasets:
        first, last = split_ranges(shares, len(indexed))[split]
        sizes.append(samples_in(int(indexed.sizes[first:last].sum(dtype=np.int64)), cfg.model.seq_length))
    if not any(sizes):
        raise ConfigError("data.path", cfg.data.path, f"no prefix holds a whole sample of model.seq_length + 1 = "
                          f"{cfg.model.seq_length + 1} tokens in the {SPLIT_NAMES[split]} split (data.split = "
                          f"{cfg.data.split!r}), so there is nothing to weigh them by",
                          f"add data, give that split a larger share, or weigh the prefixes: {EXAMPLES}")
    return sizes


def _gpt_dataset(indexed: IndexedDataset, shares: list[float], split: int, count: int, cache_dir: str | None,
                 options: SampleOptions, seed: int, build_on_this_rank: bool, barrier) -> GPTDataset:
    """Split ``split`` of one prefix, holding at least ``count`` samples."""
    return GPTDataset(indexed, split_ranges(shares, len(indexed))[split], count, options, seed,
                      cache_dir_for(indexed.prefix, cache_dir), SPLIT_NAMES[split], build_on_this_rank, barrier)


def build_eval_sets(cfg: Config, num_samples: int, build_on_this_rank: bool = True,
                    barrier: Callable[[], None] | None = None) -> list[tuple[str, object]]:
    """[(name, dataset)] of ``eval.path`` (``config.eval_sets``): every document of each set, ``num_samples``
    samples at least; the training data's split does not apply (a set is held out as a whole)."""
    sets = []
    for name, data_path in parse_eval_sets(cfg.eval.path):
        whole = replace(cfg, data=replace(cfg.data, path=data_path, split="0,1,0", mock=False))
        sets.append((name, build_train_valid_test_datasets(whole, (0, num_samples, 0), build_on_this_rank,
                                                           barrier)[1]))
    return sets
