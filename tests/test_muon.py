"""Muon on one process: torch.optim.Muon's arithmetic on the logical matrices, AdamW's on the rest; the owners'
plan; the config's refusals."""
import os
from dataclasses import replace

import pytest
import torch

from megatron_domino.config import Config
from megatron_domino.config.errors import ConfigError
from megatron_domino.config.loader import load_config
from megatron_domino.models import LanguageModel, initialize_weights
from megatron_domino.optim.distributed_optimizer import DistributedOptimizer
from megatron_domino.optim.muon_plan import assign_owners
from megatron_domino.planner.muon import block_weights, muon_balance, tp_exchange_bytes
from megatron_domino.planner.optimizer_state import state_bytes
from megatron_domino.validation import validate_config
from tests.muon_setup import GPT, LLAMA, TorchMuonReference, muon_config
from tests.training_runs import REPO
from tests.zero_setup import assert_rel

SEED, STEPS = 5, 4


def _data(cfg, steps=STEPS, batch=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=g),
             torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=g)) for _ in range(steps)]


def _loss(model, tokens, labels):
    return model(None, {"tokens": tokens, "labels": labels}).mean()


@pytest.mark.parametrize("cfg, overrides", [
    (GPT, {}), (LLAMA, {}), (LLAMA, {"muon_split_qkv": False, "muon_scale": "moonlight"}),
    (LLAMA, {"muon_nesterov": False, "muon_ns_steps": 3, "zero_stage": 0})])
def test_one_process_equals_torch_muon_and_adamw(cfg, overrides):
    """Every weight within 1e-6 of torch.optim.Muon (bf16 Newton-Schulz, the same scale rule) on Q, K, V, the
    output projection and the MLP's matrices, with torch.optim.AdamW on the embeddings, norms and head, step after
    step from the same weights and clipped gradients (``muon_setup.TorchMuonReference``)."""
    opt = muon_config(**overrides)
    reference = TorchMuonReference(cfg, opt, SEED)
    model = LanguageModel(cfg)
    initialize_weights(model, SEED)
    dopt = DistributedOptimizer([model], opt, dp_group=None, tp_rank=0, norm_groups=[])
    params = dict(model.named_global_parameters())
    for tokens, labels in _data(cfg):
        before = {name: p.detach().clone() for name, p in params.items()}
        dopt.zero_grad()
        dopt.begin_backward(True)
        _loss(model, tokens, labels).backward()
        dopt.finish_grad_sync()
        assert dopt.step(opt.lr)[0]
        clipped = {name: dopt.reduced_grad(p).view_as(p).clone() for name, p in params.items()}
        expected = reference.step(before, clipped)
        for name, param in params.items():
            assert_rel(param.detach(), expected[name], name, 1e-6)
    per_layer = (3 if opt.muon_split_qkv else 1) + 1 + (3 if cfg.activation == "swiglu" else 2)
    assert dopt.muon.orthogonalized == STEPS * per_layer * cfg.num_layers  # every matrix once per step


def test_a_refused_step_leaves_weights_and_momentum_alone():
    """The bad-step guard answers before Muon's momentum moves: a refused step changes nothing; the next one does."""
    model = LanguageModel(LLAMA)
    initialize_weights(model, SEED)
    dopt = DistributedOptimizer([model], muon_config(), dp_group=None, tp_rank=0, norm_groups=[])
    steps = iter(_data(LLAMA, 3))

    def backward():
        dopt.zero_grad()
        dopt.begin_backward(True)
        _loss(model, *next(steps)).backward()
        dopt.finish_grad_sync()
    backward()
    assert dopt.step(0.02)[0]
    weights = {n: p.detach().clone() for n, p in model.named_global_parameters()}
    momenta = {i: m.clone() for i, m in dopt.muon.momentum.items()}
    backward()
    assert not dopt.step(0.02, accept=lambda norm, local: False)[0]
    assert all(torch.equal(p, weights[n]) for n, p in model.named_global_parameters())
    assert all(torch.equal(m, momenta[i]) for i, m in dopt.muon.momentum.items())
    backward()
    assert dopt.step(0.02)[0] and not all(torch.equal(m, momenta[i]) for i, m in dopt.muon.momentum.items())


def test_owners_balance_by_flops():
    """Longest first to the least loaded: ties go to the earliest slot, every slot within one item of the mean."""
    costs = [5, 3, 3, 2, 2, 1, 1, 1]
    owners = assign_owners(costs, ["a", "b", "c"])
    assert owners == ["a", "b", "c", "b", "c", "a", "b", "c"]
    loads = {slot: sum(c for c, o in zip(costs, owners) if o == slot) for slot in "abc"}
    assert max(loads.values()) - min(loads.values()) <= max(costs)


@pytest.mark.parametrize("tp", [1, 8])
def test_llama3_8b_newton_schulz_is_balanced_at_dp8(tp):
    """The planner's owners (the optimizer's, longest first over TP x DP slots): the busiest rank within 1.3x of
    the mean at dp 8, with the shipped tp 8 and at tp 1."""
    cfg = load_config(os.path.join(REPO, "configs/llama/llama3-8b.yaml"), ["optimizer.name=muon", f"parallel.tp={tp}"])
    balance = muon_balance(cfg, 8)
    assert len(balance.flops) == 8 * tp and balance.ratio <= 1.3, balance.ratio
    print(f"tp {tp} dp 8: {balance.total / 1e12:.0f} TFLOP per step, busiest rank {balance.ratio:.3f}x the mean")


def test_gathering_moves_fewer_bytes_than_tp_newton_schulz_for_every_shipped_matrix():
    """Per TP-split matrix of every shipped dense and MoE config at its tp: sending the pieces to an owner and the
    update back moves fewer bytes than Newton-Schulz on the pieces with its Gram all-reduced per step; the latter
    wins only for a matrix cut along a side 5 (ns steps) times its other, which none is."""
    import glob
    names = sorted(glob.glob(os.path.join(REPO, "configs", "*", "*.yaml")))
    checked = 0
    for path in names:
        if "/tiny/" in path or path.endswith("base.yaml"):
            continue
        cfg = load_config(path, ["optimizer.name=muon"])
        if cfg.model.is_mla or cfg.parallel.tp == 1:
            continue
        attention, mlp = block_weights(cfg.model, cfg.optimizer)
        weights = [(w, 0) for w in attention[:-1]] + [(attention[-1], 1)]
        for ffn in {cfg.model.ffn_size, cfg.model.moe_ffn_size}:  # the dense MLP's and the experts'
            weights += [(mlp(ffn)[0], 0), (mlp(ffn)[1], 1)]
        for matrices, split in weights:
            for rows, cols in matrices:
                gather, gram = tp_exchange_bytes(rows, cols, split, cfg.parallel.tp, cfg.optimizer.muon_ns_steps)
                assert gather < gram, (path, rows, cols, split)
                checked += 1
    assert checked > 50
    assert tp_exchange_bytes(8 * 4096, 4096, 0, 8, 5)[1] < tp_exchange_bytes(8 * 4096, 4096, 0, 8, 5)[0]


@pytest.mark.parametrize("name, overrides, expected", [
    ("adamw", {}, 12), ("adamw", {"moments_dtype": "bf16"}, 8),
    ("adamw", {"master_dtype": "bf16", "moments_dtype": "bf16"}, 4),
    ("adamw", {"master_dtype": "bf16", "moments_dtype": "bf16", "master_rounding": "compensated"}, 6),
    ("muon", {}, 8), ("muon", {"moments_dtype": "bf16"}, 6), ("muon", {"master_dtype": "bf16", "moments_dtype": "bf16"},
                                                           2)])
def test_the_planner_counts_what_the_optimizer_holds(name, overrides, expected):
    """State bytes per weight of bf16 weights as planner/optimizer_state.py counts them: what
    tests/test_optimizer_states.py measures from the tensors (Muon's matrices; offloaded, the same on the host)."""
    opt = muon_config(name=name, **overrides)
    per = state_bytes(opt, 2, 1.0)
    assert per.device == expected
    assert per.offloaded_host + per.offloaded_device == expected + (2 if opt.master_dtype == "bf16" else 0)


def _problems(**optimizer):
    cfg = Config(model=GPT)
    for key, value in optimizer.items():
        setattr(cfg.optimizer, key, value)
    with pytest.raises(ConfigError) as caught:
        validate_config(cfg, world_size=1, check_paths=False)
    return [str(p) for p in caught.value.problems]


def test_bad_muon_and_state_settings_are_refused_before_any_group():
    """Each refusal names key, value, rule and fix."""
    scale = _problems(name="muon", muon_scale="rms")
    assert any(p.startswith("optimizer.muon_scale = 'rms': must be one of spectral, moonlight. Fix:") for p in scale)
    fp8 = _problems(name="adamw", moments_dtype="fp8")
    assert any(p.startswith("optimizer.moments_dtype = 'fp8': is not supported") and "Fix: use" in p for p in fp8)
    masters = _problems(master_dtype="bf16")
    assert any(p.startswith("optimizer.master_dtype = 'bf16'") and "train.bf16=true" in p for p in masters)
    clip = _problems(name="adamw", muon_qk_clip=100.0)
    assert any(p.startswith("optimizer.muon_qk_clip = 100.0") for p in clip)


def test_muon_without_matrices_is_refused():
    """A model with no 2-D hidden weight (no blocks) has nothing for Muon: refused, not silently all AdamW."""
    cfg = Config(model=replace(GPT, num_layers=0))
    cfg.optimizer.name = "muon"
    with pytest.raises(ConfigError) as caught:
        validate_config(cfg, world_size=1, check_paths=False)
    assert any(str(p).startswith("optimizer.name = 'muon': orthogonalizes the 2-D hidden weights")
               and "Fix: use optimizer.name=adamw" in str(p) for p in caught.value.problems)
