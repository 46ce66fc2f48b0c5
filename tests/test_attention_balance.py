"""Balanced packing (``data.balance_attention``, data/attention_balance.py): the attention work of a sample per CP
rank, written out by hand; the arrangement regroups the same samples (documents untouched) into micro-batches
whose (DP rank, micro-batch, CP rank) cells are within tolerance where the loader's order was not; and a run
with it trains exactly as one process without it, logging the imbalance before and after."""
import numpy as np
import pytest
import torch

from megatron_domino.config import ConfigError
from megatron_domino.config.schema import Config
from megatron_domino.data.attention_balance import AttentionBalancer, arrange, imbalance, query_work, rank_work
from megatron_domino.data.blended_dataset import BlendedDataset
from megatron_domino.data.gpt_dataset import MockGPTDataset, SampleOptions
from megatron_domino.data.loader import MicroBatchLoader
from megatron_domino.data.sample import make_sample
from megatron_domino.validation import validate_config
from tests.training_runs import losses, metrics, train

EOD = 0


def _sample(doc_lengths: list[int]) -> dict:
    """A packed sample whose documents have these lengths (each ends in an EOD)."""
    tokens = np.concatenate([np.r_[np.full(n - 1, 7), EOD] for n in doc_lengths] + [np.array([7])])
    return make_sample(tokens, EOD, reset_position_ids=True, reset_attention_mask=True)


@pytest.mark.quick
def test_a_query_attends_the_keys_of_its_document_before_it():
    assert query_work(torch.tensor([0, 3, 8]), 8).tolist() == [1, 2, 3, 1, 2, 3, 4, 5]
    assert query_work(None, 4).tolist() == [1, 2, 3, 4]


@pytest.mark.quick
def test_each_cp_rank_gets_the_work_of_the_queries_its_layout_gives_it():
    sample = _sample([3, 5])  # keys per query: 1 2 3 | 1 2 3 4 5
    # ring, cp 2: chunks of 2, rank 0 holds positions 0 1 6 7, rank 1 positions 2 3 4 5
    assert rank_work(sample, 2).tolist() == [1 + 2 + 4 + 5, 3 + 1 + 2 + 3]
    assert rank_work(_sample([8]), 2).tolist() == [1 + 2 + 7 + 8, 3 + 4 + 5 + 6]  # zig-zag balances one document
    assert rank_work(sample, 2, "a2a").tolist() == [10.5, 10.5]  # every query, half the heads each
    # a2a+ring at cp 4 (groups of 2): ring member 0 (ranks 0, 1) holds 0 1 6 7, member 1 (ranks 2, 3) 2 3 4 5
    assert rank_work(sample, 4, "a2a+ring", 2).tolist() == [6, 6, 4.5, 4.5]


@pytest.mark.quick
def test_the_arrangement_complements_heavy_and_light_samples_per_cp_rank():
    """Samples heavy on rank 0 come first in the loader's order, then samples heavy on rank 1: pairing one of
    each balances every cell; the order is a permutation, in dataset order within a micro-batch."""
    works = np.array([[9.0, 1.0]] * 4 + [[1.0, 9.0]] * 4)
    order, before, after = arrange(works, micro_batch=2, tolerance=0.0)
    assert sorted(order) == list(range(8))
    pairs = [order[i:i + 2] for i in range(0, 8, 2)]
    assert all(a < b for a, b in pairs) and [p[0] for p in pairs] == sorted(p[0] for p in pairs)
    assert all(a < 4 <= b for a, b in pairs)  # one of each kind
    assert before == pytest.approx(0.8) and after == 0.0


def _random_documents(g, length=64) -> dict:
    """A sample of ``length`` tokens cut into 1 to 6 documents at random places."""
    cuts = sorted(g.choice(np.arange(1, length), size=g.integers(0, 6), replace=False).tolist())
    return _sample(np.diff([0, *cuts, length]).tolist())


def _pairings(items):
    """Every way to cut ``items`` into pairs."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for i, partner in enumerate(rest):
        for tail in _pairings(rest[:i] + rest[i + 1:]):
            yield [(first, partner), *tail]


@pytest.mark.quick
def test_the_arrangement_is_near_the_best_grouping_of_random_documents():
    """Against every grouping of 8 samples into 4 micro-batches of 2 (105, brute force), at ring cp 2: the
    arrangement's imbalance is within the tolerance or within 10% of the best one's, never above the loader's."""
    g = np.random.default_rng(3)
    for trial in range(10):
        works = np.stack([rank_work(_random_documents(g), 2) for _ in range(8)])
        _, before, after = arrange(works, micro_batch=2, tolerance=0.01)
        best = min(imbalance(np.stack([works[list(p)].sum(0) for p in pairs])) for pairs in _pairings(list(range(8))))
        assert after <= before + 1e-12, (trial, before, after)
        assert after <= max(0.01, best * 1.1) + 1e-9, (trial, before, after, best)


@pytest.mark.quick
def test_the_loader_hands_out_the_same_samples_regrouped_and_counts_them_as_before():
    samples = [_sample([60, 4]) if i < 4 else _sample([8] * 8) for i in range(8)]  # heavy ones first
    for i, s in enumerate(samples):
        s["tokens"] = s["tokens"].clone()
        s["tokens"][-1] = 100 + i  # a tag: which sample this is
    balancer = AttentionBalancer(micro_batch=2, tolerance=0.0, cp_size=2)
    loader = MicroBatchLoader(samples, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1, arrange=balancer)
    plain = MicroBatchLoader(samples, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1)
    balanced, loader_order = loader.next_step(), plain.next_step()
    tags = lambda batches: sorted(int(t) for b in batches for t in b["tokens"][:, -1])  # noqa: E731
    assert tags(balanced) == tags(loader_order) == list(range(100, 108))
    assert loader.consumed_samples == plain.consumed_samples == 8
    window = balancer.take()
    assert window["attention_imbalance_after"] < window["attention_imbalance_before"]
    assert balancer.take() == {}


@pytest.mark.quick
def test_data_parallel_ranks_share_out_the_arranged_global_batch():
    """At dp 2 each rank reads the whole global batch, both arrange it alike, and rank r takes the r-th half of
    the micro-batches: the ranks' samples are disjoint, together the global batch, and the (rank, micro-batch,
    CP rank) cells have the imbalance of one arrangement of all 8 samples, where the loader's blocks (heavy
    samples all in rank 0's) had the plain order's."""
    samples = [_sample([60, 4]) if i < 4 else _sample([8] * 8) for i in range(8)]
    for i, s in enumerate(samples):
        s["tokens"] = s["tokens"].clone()
        s["tokens"][-1] = 100 + i
    works = {}
    for balanced in (False, True):
        cells = []
        for rank in range(2):
            balancer = AttentionBalancer(micro_batch=2, tolerance=0.05, cp_size=2) if balanced else None
            loader = MicroBatchLoader(samples, global_batch_size=8, micro_batch_size=2, dp_rank=rank, dp_size=2,
                                      arrange=balancer)
            batches = loader.next_step()
            assert loader.consumed_samples == 8 and len(batches) == 2
            for batch in batches:
                tags = [int(t) - 100 for t in batch["tokens"][:, -1]]
                cells.append((tags, sum(rank_work(samples[t], 2) for t in tags)))
        assert sorted(t for tags, _ in cells for t in tags) == list(range(8))
        works[balanced] = imbalance(np.stack([load for _, load in cells]))
    _, before, after = arrange(np.stack([rank_work(s, 2) for s in samples]), micro_batch=2, tolerance=0.05)
    assert works[False] == pytest.approx(before) and works[True] == pytest.approx(after) and after < before


@pytest.mark.quick
def test_the_ranks_arrange_from_the_cheap_layout_what_the_whole_samples_give():
    """The loader arranges from each sample's ``attention_layout`` (tokens and documents, not the whole sample):
    the same lengths and offsets as the samples themselves (mock and blended datasets), so at dp 2 the ranks
    train exactly the micro-batches an arrangement of the whole samples gives."""
    options = SampleOptions(seq_length=64, eod=99, reset_position_ids=True, reset_attention_mask=True)
    mock = [MockGPTDataset(32, 100, options, seed=1, split_index=s, document_tokens=12) for s in (0, 1)]
    blended = BlendedDataset(mock, np.array([0, 1] * 16), np.arange(32) // 2)
    for dataset in (*mock, blended):
        for i in range(len(dataset)):
            cheap, whole = dataset.attention_layout(i), dataset[i]
            assert torch.equal(cheap["tokens"], whole["tokens"]) and torch.equal(cheap["doc_offsets"],
                                                                                 whole["doc_offsets"])
    balancer = AttentionBalancer(micro_batch=2, tolerance=0.0, cp_size=2)
    whole = [mock[0][i] for i in range(16)]
    order = balancer(whole)
    for rank in range(2):
        loader = MicroBatchLoader(mock[0], global_batch_size=16, micro_batch_size=2, dp_rank=rank, dp_size=2,
                                  arrange=balancer)
        got = torch.cat([batch["tokens"] for batch in loader.next_step()])
        assert torch.equal(got, torch.stack([whole[k]["tokens"] for k in order[rank * 8:(rank + 1) * 8]]))


@pytest.mark.quick
@pytest.mark.parametrize("overrides, rule", [
    ({}, "data.reset_attention_mask"),
    ({"reset_attention_mask": True, "balance_tolerance": -0.1}, "data.balance_tolerance"),
])
def test_balancing_without_documents_or_a_negative_tolerance_is_refused(overrides, rule):
    cfg = Config()
    cfg.data.mock, cfg.data.balance_attention = True, True
    for key, value in overrides.items():
        setattr(cfg.data, key, value)
    with pytest.raises(ConfigError, match=rule):
        validate_config(cfg, world_size=1, check_paths=False)


@pytest.mark.quick
def test_balancing_an_moe_whose_losses_are_the_micro_batch_s_is_refused():
    cfg = Config()
    cfg.data.mock, cfg.data.balance_attention, cfg.data.reset_attention_mask = True, True, True
    cfg.model.num_experts, cfg.model.moe_aux_loss_coeff = 4, 0.01
    with pytest.raises(ConfigError, match="moe_aux_loss_coeff=0"):
        validate_config(cfg, world_size=1, check_paths=False)


DOCUMENTS = ["data.reset_attention_mask=true", "data.reset_position_ids=true", "data.mock_document_tokens=12",
             "train.steps=4", "train.global_batch_size=16", "train.micro_batch_size=2", "log.interval=1"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.cp=2", "parallel.pp=2"], ["parallel.cp=2", "parallel.dp=2"]],
                         ids=["cp2-pp2", "cp2-dp2"])
def test_a_balanced_run_trains_as_one_process_without_balancing(tmp_path, layout):
    """The tiny Llama, 4 steps, packed mock documents: one process in the loader's order, and cp 2 x pp 2 (8
    micro-batches per step) or cp 2 x dp 2 (4 per rank, the DP ranks' samples arranged together) balanced: the
    same losses and gradient norms (1e-5), and the imbalance logged."""
    single, balanced = str(tmp_path / "single"), str(tmp_path / "balanced")
    train("llama", 1, single, DOCUMENTS)
    train("llama", 4, balanced, [*DOCUMENTS, *layout, "data.balance_attention=true", "data.balance_tolerance=0"])
    one, many = losses(single), losses(balanced)
    assert sorted(one) == sorted(many) == [1, 2, 3, 4]
    for step in one:
        assert abs(many[step] - one[step]) <= 1e-5 * abs(one[step]), (step, many[step], one[step])
    records = metrics(balanced)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # one writer: the last stage's first TP, DP and CP rank
    for r, ref in zip(records, metrics(single)):
        assert abs(r["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"]
        assert 0 <= r["attention_imbalance_after"] < r["attention_imbalance_before"], r
    assert "attention_imbalance_before" not in metrics(single)[0]
