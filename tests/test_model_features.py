"""Single-process checks of the model's switches: RNG streams, recompute, document masks, launch env."""
import os

import torch

from megatron_domino.config import ModelConfig
from megatron_domino.models import LanguageModel, initialize_weights
from megatron_domino.parallel import launch
from megatron_domino.parallel.random import capture_rng_state, get_tracker, restore_rng_state, seed_streams

CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                  vocab_size=100, make_vocab_size_divisible_by=4)


def _masks(tp_rank, pp_rank=0):
    seed_streams(42, tp_rank=tp_rank, pp_rank=pp_rank)
    with get_tracker().fork():
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
    seed_streams(7, tp_rank=1)
    saved = capture_rng_state()
    with get_tracker().fork():
        first_tp = torch.rand(8)
    first_default = torch.rand(8)
    restore_rng_state(saved)
    with get_tracker().fork():
        assert torch.equal(torch.rand(8), first_tp)
    assert torch.equal(torch.rand(8), first_default)


def _grads_with_recompute(mode):
    cfg = ModelConfig(**{**CFG.__dict__, "attention_dropout": 0.2, "hidden_dropout": 0.2, "recompute": mode})
    model = LanguageModel(cfg)
    initialize_weights(model, seed=3)
    seed_streams(11)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    loss = model(None, {"tokens": tokens, "labels": tokens.roll(-1, 1)}).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_recompute_gives_identical_gradients_with_dropout_on():
    loss, grads = _grads_with_recompute("none")
    for mode in ("full", "selective"):
        other_loss, other = _grads_with_recompute(mode)
        assert torch.equal(loss, other_loss), mode
        for name, grad in grads.items():
            assert torch.equal(grad, other[name]), (mode, name)
    assert not torch.equal(loss, _loss_without_dropout())  # dropout really was on


def _loss_without_dropout():
    model = LanguageModel(CFG)
    initialize_weights(model, seed=3)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_length), generator=torch.Generator().manual_seed(0))
    return model(None, {"tokens": tokens, "labels": tokens.roll(-1, 1)}).mean().detach()


def test_document_mask_and_position_reset_isolate_documents():
    """Two packed documents with EOD resets give each document the loss it has alone."""
    for cfg in (CFG, ModelConfig(**{**CFG.__dict__, "position_embedding": "rope", "norm": "rmsnorm"})):
        model = LanguageModel(cfg).eval()
        initialize_weights(model, seed=5)
        g = torch.Generator().manual_seed(1)
        first, second = torch.randint(0, cfg.vocab_size, (1, 6), generator=g), torch.randint(0, 99, (1, 10), generator=g)
        packed = torch.cat([first, second], dim=1)
        labels = packed.roll(-1, 1)
        document = torch.tensor([0] * 6 + [1] * 10)
        causal = torch.ones(16, 16, dtype=torch.bool).tril()
        mask = (causal & (document[:, None] == document[None, :]))[None, None]
        positions = torch.cat([torch.arange(6), torch.arange(10)])[None]
        with torch.no_grad():
            packed_loss = model(None, {"tokens": packed, "labels": labels, "position_ids": positions,
                                       "attention_mask": mask})
            alone = model(None, {"tokens": torch.cat([second, torch.zeros(1, 6, dtype=torch.long)], dim=1),
                                 "labels": torch.cat([labels[:, 6:], torch.zeros(1, 6, dtype=torch.long)], dim=1)})
        torch.testing.assert_close(packed_loss[0, 6:], alone[0, :10], rtol=1e-5, atol=1e-5)


def test_slurm_variables_map_to_torchrun_ones(monkeypatch):
    environment = {"SLURM_PROCID": "13", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
                   "SLURM_JOB_NODELIST": "gpu[003-010,012],cpu1"}
    monkeypatch.setattr(os, "environ", environment)  # the real environment stays untouched
    launch._slurm_to_torchrun_env()
    assert (environment["RANK"], environment["WORLD_SIZE"], environment["LOCAL_RANK"]) == ("13", "16", "5")
    assert environment["MASTER_ADDR"] == "gpu003" and environment["MASTER_PORT"] == "29500"
    assert launch._first_slurm_host("node7") == "node7"
