"""MicroBatchLoader: the same global batches for any dp, exact resume, wrap-around, argument errors, padding."""
import numpy as np
import pytest
import torch

from megatron_domino.config.schema import Config
from megatron_domino.data import IndexedDatasetBuilder, MicroBatchLoader, build_train_valid_test_datasets
from megatron_domino.data.loader import collate

SEQ, GLOBAL, MICRO = 8, 8, 2


def real_dataset(tmp_path):
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(str(tmp_path / "d"), np.uint16) as builder:
        for _ in range(30):
            builder.add_document(np.append(rng.integers(0, 63, rng.integers(1, 20)), 63))
        builder.finalize()
    cfg = Config()
    cfg.model.seq_length, cfg.model.vocab_size = SEQ, 64
    cfg.data.path, cfg.data.split, cfg.data.cache_dir = [str(tmp_path / "d")], "1,0,0", str(tmp_path / "cache")
    cfg.data.reset_attention_mask = True
    return build_train_valid_test_datasets(cfg, (80, 0, 0))[0]


def mock_dataset():
    cfg = Config()
    cfg.model.seq_length, cfg.model.vocab_size, cfg.data.mock = SEQ, 64, True
    return build_train_valid_test_datasets(cfg, (80, 0, 0))[0]


def documents(offsets):
    """Each row's document offsets without the padding (the repeated L): micro-batches pad to their own widths."""
    return [torch.unique_consecutive(row).tolist() for row in offsets]


def concatenate(key, tensors):
    return sum((documents(t) for t in tensors), []) if key == "doc_offsets" else torch.cat(tensors)


def equal(key, a, b):
    return a == b if key == "doc_offsets" else torch.equal(a, b)


def global_batches(dataset, dp, steps, consumed=0):
    """Per step, the global batch: every rank's micro-batches concatenated in rank order."""
    loaders = [MicroBatchLoader(dataset, GLOBAL, MICRO, r, dp, consumed_samples=consumed) for r in range(dp)]
    batches = []
    for _ in range(steps):
        per_rank = [loader.next_step() for loader in loaders]
        assert all(len(micro) == GLOBAL // (MICRO * dp) for micro in per_rank)
        micro = [m for rank in per_rank for m in rank]
        batches.append({k: concatenate(k, [m[k] for m in micro]) for k in micro[0]})
    assert {loader.consumed_samples for loader in loaders} == {consumed + steps * GLOBAL}
    return batches


@pytest.mark.parametrize("make", ["real", "mock"])
def test_same_global_batches_for_dp_1_2_4(tmp_path, make):
    dataset = real_dataset(tmp_path) if make == "real" else mock_dataset()
    reference = [{k: concatenate(k, [dataset[i][k][None] for i in range(g * GLOBAL, (g + 1) * GLOBAL)])
                  for k in dataset[0]} for g in range(5)]  # global batch g = samples [g*G, (g+1)*G)
    for dp in (1, 2, 4):
        got = global_batches(dataset, dp, 5)
        for expected, batch in zip(reference, got):
            assert expected.keys() == batch.keys()
            for key in expected:
                assert equal(key, expected[key], batch[key]), (dp, key)
    micro = MicroBatchLoader(dataset, GLOBAL, MICRO, 0, 2).next_step()[0]
    assert micro["tokens"].shape == (MICRO, SEQ) and micro["loss_mask"].dtype == torch.float32
    if make == "real":
        assert micro["doc_offsets"].dtype == torch.int32 and micro["doc_offsets"].shape[0] == MICRO


def test_collate_pads_document_offsets_with_empty_documents():
    samples = [{"tokens": torch.zeros(SEQ), "doc_offsets": torch.tensor(offsets, dtype=torch.int32)}
               for offsets in ([0, 3, SEQ], [0, SEQ], [0, 1, 2, 5, SEQ])]
    batch = collate(samples)
    assert batch["tokens"].shape == (3, SEQ) and batch["doc_offsets"].dtype == torch.int32
    assert batch["doc_offsets"].tolist() == [[0, 3, SEQ, SEQ, SEQ], [0, SEQ, SEQ, SEQ, SEQ], [0, 1, 2, 5, SEQ]]


def test_resume_mid_epoch_continues_exactly(tmp_path):
    dataset = real_dataset(tmp_path)
    uninterrupted = global_batches(dataset, 2, 7)
    loader = MicroBatchLoader(dataset, GLOBAL, MICRO, 1, 2)
    for _ in range(3):
        loader.next_step()
    state = loader.state_dict()
    assert state == {"consumed_samples": 3 * GLOBAL}
    resumed = global_batches(dataset, 4, 4, consumed=state["consumed_samples"])  # and on another dp
    for expected, batch in zip(uninterrupted[3:], resumed):
        assert all(equal(k, expected[k], batch[k]) for k in expected)
    fresh = MicroBatchLoader(dataset, GLOBAL, MICRO, 1, 2)
    fresh.load_state_dict(state)
    assert fresh.rank_sample_ids() == loader.rank_sample_ids() == list(range(28, 32))


def test_wraps_with_a_warning_when_exhausted():
    dataset = mock_dataset()
    loader = MicroBatchLoader(dataset, GLOBAL, MICRO, 0, 1, consumed_samples=len(dataset) - 4)
    with pytest.warns(UserWarning, match="wrapping to its start"):
        ids = loader.rank_sample_ids()
    assert ids == [76, 77, 78, 79, 0, 1, 2, 3]


def test_argument_errors():
    dataset = mock_dataset()
    with pytest.raises(ValueError, match="global_batch_size=10 must be a positive multiple"):
        MicroBatchLoader(dataset, 10, 2, 0, 2)
    with pytest.raises(ValueError, match="dp_rank=2"):
        MicroBatchLoader(dataset, 8, 2, 2, 2)
