"""Single-process checks of the model's switches: RNG streams, recompute, packed documents, launch env."""
import os

import torch

from megatron_domino.config import ModelConfig
from megatron_domino.data.loader import pad_offsets
from megatron_domino.models import LanguageModel, initialize_weights
from megatron_domino.models.recompute import apply_recompute
from megatron_domino.parallel import launch
from megatron_domino.parallel.random import RNGTracker
from megatron_domino.tensor_parallel import LayerContext

CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                  vocab_size=100, make_vocab_size_divisible_by=4)


def _masks(tp_rank, pp_rank=0):
    rng = RNGTracker.seeded(42, tp_rank=tp_rank, pp_rank=pp_rank)
    with rng.fork():
        tp_mask = torch.rand(64) > 0.5
    return tp_mask, torch.rand(64) > 0.5  # the second is drawn from the default stream


def test_tp_stream_differs_per_tp_rank_and_default_stream_does_not():
    tp0, default0 = _masks(tp_rank=0)
    tp1, default1 = _masks(tp_rank=1)
    replica, default_replica = _masks(tp_rank=0)  # another DP replica of TP rank 0
    assert not torch.equal(tp0, tp1)
    assert torch.equal(tp0, replica) and torch.equal(default0, default_replica)
    assert torch.equal(default0, default1)
    _, other_stage = _masks(tp_rank=0, pp_rank=1)
    assert not torch.equal(default0, other_stage)


def test_rng_state_round_trip_replays_both_streams():
    rng = RNGTracker.seeded(7, tp_rank=1)
    saved = rng.capture()
    with rng.fork():
        first_tp = torch.rand(8)
    first_default = torch.rand(8)
    rng.restore(saved)
    with rng.fork():
        assert torch.equal(torch.rand(8), first_tp)
    assert torch.equal(torch.rand(8), first_default)


def _grads_with_recompute(mode):
    """Loss, gradients and the bytes autograd kept for backward outside recomputed regions."""
    cfg = ModelConfig(**{**CFG.__dict__, "attention_dropout": 0.2, "hidden_dropout": 0.2, "recompute": mode})
    rng = RNGTracker.seeded(11)  # attention dropout draws from its TP stream, which recompute must replay too
    model = LanguageModel(cfg, LayerContext(rng=rng))
    initialize_weights(model, seed=3)
    apply_recompute(model, mode, rng)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        loss = model(None, {"tokens": tokens, "labels": tokens.roll(-1, 1)}).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(kept)


def test_recompute_gives_identical_gradients_with_dropout_on():
    loss, grads, kept = _grads_with_recompute("none")
    kept_by_mode = {}
    for mode in ("full", "selective"):
        other_loss, other, kept_by_mode[mode] = _grads_with_recompute(mode)
        assert torch.equal(loss, other_loss), mode
        for name, grad in grads.items():
            assert torch.equal(grad, other[name]), (mode, name)
    assert kept_by_mode["full"] < kept_by_mode["selective"] < kept, (kept_by_mode, kept)  # recompute really ran
    assert not torch.equal(loss, _loss_without_dropout())  # dropout really was on


def _loss_without_dropout():
    model = LanguageModel(CFG)
    initialize_weights(model, seed=3)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_length), generator=torch.Generator().manual_seed(0))
    return model(None, {"tokens": tokens, "labels": tokens.roll(-1, 1)}).mean().detach()


def _packed_and_alone(cfg):
    """Per-token losses and gradients of two packed rows (padded offsets) and of each document run alone."""
    model = LanguageModel(cfg)
    initialize_weights(model, seed=5)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, cfg.vocab_size, (2, 2, cfg.seq_length), generator=g)
    rows = [[0, 6, 16], [0, 1, 2, 9, 16]]
    offsets = pad_offsets([torch.tensor(row, dtype=torch.int32) for row in rows])
    positions = torch.stack([torch.cat([torch.arange(b - a) for a, b in zip(row, row[1:])]) for row in rows])
    packed = model(None, {"tokens": tokens, "labels": labels, "position_ids": positions, "doc_offsets": offsets})
    packed_grads = torch.autograd.grad(packed.sum(), list(model.parameters()))
    alone = torch.zeros_like(packed)
    for i, row in enumerate(rows):
        for a, b in zip(row, row[1:]):
            alone[i, a:b] = model(None, {"tokens": tokens[i:i + 1, a:b], "labels": labels[i:i + 1, a:b],
                                         "position_ids": torch.arange(b - a)[None]})[0]
    alone_grads = torch.autograd.grad(alone.sum(), list(model.parameters()))
    return packed, packed_grads, alone, alone_grads


def test_packed_documents_train_as_if_each_ran_alone():
    """With document offsets and position resets, each packed document's losses and its share of the gradients
    equal those of the document run alone: GPT; Llama-style with GQA on the flash kernel and both recomputes."""
    llama = {"position_embedding": "rope", "norm": "rmsnorm", "num_query_groups": 2, "attention_backend": "flash"}
    for changes in ({}, llama, {**llama, "recompute": "selective"}, {**llama, "recompute": "full"}):
        packed, packed_grads, alone, alone_grads = _packed_and_alone(ModelConfig(**{**CFG.__dict__, **changes}))
        torch.testing.assert_close(packed, alone, rtol=1e-6, atol=1e-6)
        for grad, expected in zip(packed_grads, alone_grads):
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


def test_slurm_variables_map_to_torchrun_ones(monkeypatch):
    environment = {"SLURM_PROCID": "13", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
                   "SLURM_JOB_NODELIST": "gpu[003-010,012],cpu1"}
    monkeypatch.setattr(os, "environ", environment)  # the real environment stays untouched
    launch._slurm_to_torchrun_env()
    assert (environment["RANK"], environment["WORLD_SIZE"], environment["LOCAL_RANK"]) == ("13", "16", "5")
    assert environment["MASTER_ADDR"] == "gpu003" and environment["MASTER_PORT"] == "29500"
    assert launch._first_slurm_host("node7") == "node7"
