"""Blending several datasets with weights: each sample is drawn from the dataset furthest below its share.

After n samples the ideal count of dataset d is w_d * n; sample n goes to the dataset whose realised count
lags that ideal the most (ties to the lower index). Realised counts therefore never differ from the ideal
by a sample or more, so ratios track the weights from the first batches on, deterministically, without
a random generator. The choice depends only on the weights, so it is computed first and tells each
dataset exactly how many samples it must provide.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .index_cache import load_or_build


def normalize_weights(weights) -> list[float]:
    weights = [float(w) for w in weights]
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"blend weights {weights} must be non-negative with a positive sum; data.path is "
                         f"['w1', 'PREFIX1', 'w2', 'PREFIX2', ...]")
    total = sum(weights)
    return [w / total for w in weights]


def build_blending_indices(weights: list[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """For each blended sample: which dataset it comes from, and its sample number within that dataset."""
    weights = normalize_weights(weights)
    counts = [0] * len(weights)
    choice = np.empty(num_samples, dtype=np.int16 if len(weights) < 2**15 else np.int32)
    within = np.empty(num_samples, dtype=np.int64)
    datasets = range(len(weights))
    for i in range(num_samples):
        ideal = i + 1
        d = max(datasets, key=lambda k: weights[k] * ideal - counts[k])
        choice[i], within[i] = d, counts[d]
        counts[d] += 1
    return choice, within


def load_blending_indices(weights: list[float], num_samples: int, cache_dir: str, description: dict,
                          build_on_this_rank: bool = True, barrier: Callable[[], None] | None = None):
    """``build_blending_indices`` through the on-disk index cache (it is a Python loop over every sample)."""
    weights = normalize_weights(weights)
    full = dict(description, kind="BlendedDataset", weights=weights, num_samples=int(num_samples))

    def build() -> dict:
        choice, within = build_blending_indices(weights, num_samples)
        return {"dataset_index": choice, "dataset_sample_index": within}

    arrays = load_or_build(cache_dir, full, ("dataset_index", "dataset_sample_index"), build,
                           build_on_this_rank, barrier)
    return arrays["dataset_index"], arrays["dataset_sample_index"]


class BlendedDataset(torch.utils.data.Dataset):
    """Sample i is sample ``dataset_sample_index[i]`` of ``datasets[dataset_index[i]]``."""

    def __init__(self, datasets: list, dataset_index: np.ndarray, dataset_sample_index: np.ndarray):
        needed = np.bincount(np.asarray(dataset_index, dtype=np.int64), minlength=len(datasets))
        for d, (dataset, count) in enumerate(zip(datasets, needed)):
            if count and (dataset is None or len(dataset) < count):
                have = 0 if dataset is None else len(dataset)
                raise ValueError(f"blended dataset {d} provides {have} samples but the blend needs {count}")
        self.datasets = datasets
        self.dataset_index, self.dataset_sample_index = dataset_index, dataset_sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> dict:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    def attention_layout(self, i: int) -> dict:
        return self.datasets[int(self.dataset_index[i])].attention_layout(int(self.dataset_sample_index[i]))

    def documents(self, i: int) -> list[str]:
        return self.datasets[int(self.dataset_index[i])].documents(int(self.dataset_sample_index[i]))
