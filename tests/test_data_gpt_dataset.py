"""GPT dataset: packing against a direct concatenation, index properties, caching, determinism, splits, masks."""
import threading

import numpy as np
import pytest
import torch

from megatron_domino.config.schema import Config
from megatron_domino.data import (
    IndexedDataset,
    IndexedDatasetBuilder,
    build_train_valid_test_datasets,
    gpt_index,
    make_sample,
)
from megatron_domino.data.gpt_dataset import GPTDataset, MockGPTDataset, SampleOptions

SEQ = 16
EOD = 99


def make_corpus(prefix, n_docs=40, seed=0):
    """Documents of varied length (some shorter than a sample, some longer), each ending in EOD."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(0, EOD, rng.integers(1, 3 * SEQ)), EOD) for _ in range(n_docs)]
    with IndexedDatasetBuilder(str(prefix), np.uint16) as builder:
        for doc in docs:
            builder.add_document(doc)
        builder.finalize()
    return docs


def gpt(tmp_path, indexed, num_samples, seed=1234, cache="cache", doc_range=None):
    return GPTDataset(indexed, doc_range or (0, len(indexed)), num_samples, SampleOptions(SEQ, EOD), seed,
                      str(tmp_path / cache), "train")


def test_samples_are_the_concatenated_documents(tmp_path):
    docs = make_corpus(tmp_path / "d")
    ds = gpt(tmp_path, IndexedDataset(str(tmp_path / "d")), num_samples=150)
    tokens_per_epoch = sum(len(d) for d in docs)
    epochs = len(ds.document_index) // len(docs)
    assert epochs * tokens_per_epoch >= 150 * SEQ + 1 > (epochs - 1) * tokens_per_epoch  # just enough epochs
    for e in range(epochs):  # every epoch is a permutation of all documents
        assert sorted(ds.document_index[e * len(docs):(e + 1) * len(docs)]) == list(range(len(docs)))
    stream = np.concatenate([docs[d] for d in ds.document_index])
    assert len(ds) == (len(stream) - 1) // SEQ >= 150
    assert sorted(ds.shuffle_index) == list(range(len(ds)))
    for i in range(len(ds)):
        s = int(ds.shuffle_index[i])
        np.testing.assert_array_equal(ds.sample_tokens(i), stream[s * SEQ:s * SEQ + SEQ + 1])
    item = ds[0]
    assert torch.equal(item["tokens"][1:], item["labels"][:-1])
    assert item["tokens"].dtype == torch.int64 and item["tokens"].shape == (SEQ,)


def test_epochs_are_served_in_order(tmp_path):
    docs = make_corpus(tmp_path / "d")
    ds = gpt(tmp_path, IndexedDataset(str(tmp_path / "d")), num_samples=200)
    tokens_per_epoch = sum(len(d) for d in docs)
    served_epoch = (np.asarray(ds.shuffle_index, dtype=np.int64) + 1) * SEQ // tokens_per_epoch  # of last token
    assert np.all(np.diff(served_epoch) >= 0) and served_epoch[-1] >= 1
    assert not np.all(np.diff(np.asarray(ds.shuffle_index, dtype=np.int64)) > 0)  # shuffled within an epoch


def test_deterministic_cached_and_seed_dependent(tmp_path, monkeypatch):
    make_corpus(tmp_path / "d")
    indexed = IndexedDataset(str(tmp_path / "d"))
    a = gpt(tmp_path, indexed, 100, cache="c1")
    b = gpt(tmp_path, indexed, 100, cache="c2")
    other_seed = gpt(tmp_path, indexed, 100, seed=7, cache="c1")
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.document_index, other_seed.document_index)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("indices were rebuilt instead of loaded from the cache")

    monkeypatch.setattr(gpt_index, "build_document_index", no_rebuild)
    cached = gpt(tmp_path, indexed, 100, cache="c1")
    assert all(np.array_equal(cached.sample_tokens(i), a.sample_tokens(i)) for i in range(len(a)))


def test_more_samples_keep_the_first_epoch(tmp_path):
    docs = make_corpus(tmp_path / "d")
    indexed = IndexedDataset(str(tmp_path / "d"))
    short, long = gpt(tmp_path, indexed, 40), gpt(tmp_path, indexed, 300)
    assert len(short.document_index) == len(docs) < len(long.document_index)  # one epoch against several
    for i in range(len(short)):
        np.testing.assert_array_equal(short.sample_tokens(i), long.sample_tokens(i))


def test_split_ranges_cover_documents_once():
    for n in (0, 1, 7, 100, 1001):
        for split in ("949,50,1", "1,1,1", "8,2,0", "1", "0.5/0.5"):
            ranges = gpt_index.split_ranges(gpt_index.parse_split(split), n)
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(ranges[i][1] == ranges[i + 1][0] and ranges[i][0] <= ranges[i][1] for i in range(2))
    assert gpt_index.split_ranges(gpt_index.parse_split("8,2,0"), 10) == [(0, 8), (8, 10), (10, 10)]
    with pytest.raises(ValueError, match="data.split='a,b'"):
        gpt_index.parse_split("a,b")


def reference_masks(tokens, eod):
    """Megatron's loop formulation of EOD resets, for comparison with the vectorised one."""
    length = len(tokens)
    allowed = np.tril(np.ones((length, length), dtype=bool))
    positions = np.arange(length)
    previous = 0
    for i in np.nonzero(tokens == eod)[0]:
        allowed[i + 1:, :i + 1] = False
        positions[i + 1:] -= i + 1 - previous
        previous = i + 1
    return allowed, positions


def mask_from_offsets(offsets, length):
    """The dense mask the document offsets stand for: causal within [offsets[j], offsets[j + 1])."""
    document = np.searchsorted(np.asarray(offsets), np.arange(length), side="right")
    return np.tril(np.ones((length, length), dtype=bool)) & (document[:, None] == document[None, :])


def test_eod_resets_match_the_loop_formulation():
    rng = np.random.default_rng(3)
    for _ in range(20):
        tokens = rng.integers(0, 5, SEQ + 1)  # EOD = 4 appears often, also first and last
        sample = make_sample(tokens, 4, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
        allowed, positions = reference_masks(tokens[:-1], 4)
        starts = [i + 1 for i in np.nonzero(tokens[:-2] == 4)[0]]  # an EOD in the last position starts none
        offsets = sample["doc_offsets"]
        assert offsets.dtype == torch.int32 and offsets.tolist() == [0, *starts, SEQ]
        np.testing.assert_array_equal(mask_from_offsets(offsets.numpy(), SEQ), allowed)
        np.testing.assert_array_equal(sample["position_ids"].numpy(), positions)
        np.testing.assert_array_equal(sample["loss_mask"].numpy(), (tokens[:-1] != 4).astype(np.float32))
        np.testing.assert_array_equal(sample["labels"].numpy(), tokens[1:])
    plain = make_sample(tokens, 4)
    assert "doc_offsets" not in plain and plain["loss_mask"].sum() == SEQ
    assert plain["position_ids"].tolist() == list(range(SEQ))


def config(tmp_path, **data):
    cfg = Config()
    cfg.model.seq_length, cfg.model.vocab_size = SEQ, EOD + 1
    cfg.data.cache_dir = str(tmp_path / "cache")
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def test_builder_splits_and_rank0_builds_once(tmp_path, monkeypatch):
    make_corpus(tmp_path / "d", n_docs=100)
    cfg = config(tmp_path, path=[str(tmp_path / "d")], split="8,2,0", reset_position_ids=True)
    builds, real = [], gpt_index.build_sample_index
    monkeypatch.setattr(gpt_index, "build_sample_index", lambda *a: builds.append(1) or real(*a))
    barrier, results = threading.Barrier(2), {}

    def rank(r):
        results[r] = build_train_valid_test_datasets(cfg, (50, 10, 5), build_on_this_rank=r == 0,
                                                     barrier=barrier.wait)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 2  # train and valid, built once each (by rank 0)
    (train, valid, test), (train1, _, _) = results[0], results[1]
    assert test is None and len(train) >= 50 and len(valid) >= 10
    assert set(train.document_index) == set(range(80)) and set(valid.document_index) == set(range(80, 100))
    assert all(torch.equal(train[i]["tokens"], train1[i]["tokens"]) for i in range(len(train)))
    assert "position_ids" in train[0] and "doc_offsets" not in train[0]


def test_mock_dataset_is_deterministic_and_has_eods(tmp_path):
    cfg = config(tmp_path, mock=True, reset_attention_mask=True)
    cfg.model.vocab_size = 50
    train, valid, test = build_train_valid_test_datasets(cfg, (64, 8, 0))
    again, _, _ = build_train_valid_test_datasets(cfg, (64, 8, 0))
    assert test is None and len(train) == 64 and len(valid) == 8
    assert torch.equal(train[5]["tokens"], again[5]["tokens"])
    assert not torch.equal(train[5]["tokens"], valid[5]["tokens"])
    tokens = torch.stack([train[i]["tokens"] for i in range(64)])
    assert tokens.max() == 49 and tokens.min() >= 0 and (tokens == 49).sum() > 0
    offsets = train[0]["doc_offsets"].tolist()
    assert offsets[0] == 0 and offsets[-1] == SEQ and offsets == sorted(set(offsets))
    assert isinstance(train, MockGPTDataset)


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match=r"data.path = None: is empty"):
        build_train_valid_test_datasets(config(tmp_path), (1, 0, 0))
    with pytest.raises(ValueError, match=r"data.path\[2\] = 'x': must be a positive number"):
        build_train_valid_test_datasets(config(tmp_path, path=["0.5", "a", "x", "b"]), (1, 0, 0))
    with pytest.raises(FileNotFoundError, match="preprocess_data.py"):
        build_train_valid_test_datasets(config(tmp_path, path=[str(tmp_path / "missing")]), (1, 0, 0))
    with pytest.raises(ValueError, match="train split no share"):
        build_train_valid_test_datasets(config(tmp_path, mock=True, split="0,1,0"), (1, 0, 0))
