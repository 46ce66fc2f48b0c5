"""Blending: realised ratios track the weights (within 1% after 10k samples), deterministically."""
import numpy as np
import pytest

from megatron_domino.config import ConfigError
from megatron_domino.config.schema import Config
from megatron_domino.data import (
    BlendedDataset,
    IndexedDatasetBuilder,
    build_blending_indices,
    build_train_valid_test_datasets,
)

SEQ = 8


def test_realised_ratios_within_one_percent_after_10k():
    weights = [0.2, 0.3, 0.5]
    choice, within = build_blending_indices([2, 3, 5], 10_000)  # unnormalised weights are fine
    counts = np.bincount(choice, minlength=3)
    assert np.all(np.abs(counts / 10_000 - weights) <= 0.01 * np.array(weights))
    running = np.cumsum(np.eye(3, dtype=np.int64)[choice], axis=0)  # realised counts after each sample
    ideal = np.arange(1, 10_001)[:, None] * np.array(weights)
    assert np.abs(running - ideal).max() < 1.0  # never a whole sample away from the weights
    for d in range(3):  # each dataset's samples are used in order 0, 1, 2, ...
        assert within[choice == d].tolist() == list(range(counts[d]))
    again = build_blending_indices([0.2, 0.3, 0.5], 10_000)
    assert np.array_equal(choice, again[0]) and np.array_equal(within, again[1])


def test_weight_errors():
    with pytest.raises(ValueError, match="non-negative with a positive sum"):
        build_blending_indices([0.5, -0.1], 10)
    with pytest.raises(ValueError, match="needs 3"):
        BlendedDataset([list(range(2))], np.zeros(3, np.int16), np.arange(3))


def make_prefix(path, low, high, seed, length=None):
    """A dataset whose tokens all lie in [low, high), so a sample reveals which dataset it came from.

    20 documents of ``length`` tokens each (default: random lengths below 30).
    """
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(str(path), np.uint16) as builder:
        for _ in range(20):
            builder.add_document(rng.integers(low, high, length or rng.integers(1, 30)))
        builder.finalize()


def test_blended_splits_from_config(tmp_path):
    make_prefix(tmp_path / "a", 0, 50, 0)
    make_prefix(tmp_path / "b", 50, 100, 1)
    cfg = Config()
    cfg.model.seq_length, cfg.model.vocab_size = SEQ, 101
    cfg.data.path = ["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")]
    cfg.data.split, cfg.data.cache_dir = "9,1,0", str(tmp_path / "cache")
    train, valid, test = build_train_valid_test_datasets(cfg, (10_000, 200, 0))
    assert test is None and len(train) == 10_000 and len(valid) == 200
    share_b = float(np.mean(np.asarray(train.dataset_index) == 1))
    assert abs(share_b - 0.7) <= 0.007
    for i in range(0, 10_000, 37):
        tokens = train[i]["tokens"]
        from_b = bool(tokens.min() >= 50)
        assert from_b == bool(train.dataset_index[i] == 1) and (from_b or tokens.max() < 50)
    again, _, _ = build_train_valid_test_datasets(cfg, (10_000, 200, 0))
    assert all((again[i]["tokens"] == train[i]["tokens"]).all() for i in range(0, 10_000, 101))


def test_unweighted_prefixes_mix_by_their_size(tmp_path):
    """Megatron's rule for data.path=[A, B]: each prefix weighs the samples one pass over its split holds."""
    make_prefix(tmp_path / "a", 0, 50, 0, length=10)  # 200 tokens: (200 - 1) // 8 = 24 samples
    make_prefix(tmp_path / "b", 50, 100, 1, length=30)  # 600 tokens: (600 - 1) // 8 = 74 samples
    cfg = Config()
    cfg.model.seq_length, cfg.model.vocab_size = SEQ, 101
    cfg.data.path = [str(tmp_path / "a"), str(tmp_path / "b")]
    cfg.data.split, cfg.data.cache_dir = "1,0,0", str(tmp_path / "cache")
    train, valid, _ = build_train_valid_test_datasets(cfg, (1_000, 0, 0))
    assert valid is None and len(train) == 1_000
    share_b = float(np.mean(np.asarray(train.dataset_index) == 1))
    assert share_b == pytest.approx(74 / 98, abs=0.002)
    for i in range(0, 1_000, 37):
        assert bool(train[i]["tokens"].min() >= 50) == bool(train.dataset_index[i] == 1)


def test_unweighted_prefixes_without_a_whole_sample_name_data_path(tmp_path):
    make_prefix(tmp_path / "a", 0, 50, 0, length=1)
    make_prefix(tmp_path / "b", 50, 100, 1, length=1)
    cfg = Config()
    cfg.model.seq_length, cfg.model.vocab_size = 64, 101
    cfg.data.path = [str(tmp_path / "a"), str(tmp_path / "b")]
    cfg.data.split, cfg.data.cache_dir = "1,0,0", str(tmp_path / "cache")
    with pytest.raises(ConfigError, match=r"data.path = .*no prefix holds a whole sample.*Fix: "):
        build_train_valid_test_datasets(cfg, (10, 0, 0))
