"""Analytic parameter and FLOP counts against published model sizes, HF models and torch's FLOP counter."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_domino.config import ModelConfig, load_config
from megatron_domino.models.counters import count_parameters, flops_per_token

transformers = pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def preset(name: str) -> ModelConfig:
    return load_config(os.path.join(REPO, "configs", f"{name}.yaml")).model


@pytest.mark.parametrize("name, published", [
    ("gpt/175b", 174.6e9),          # GPT-3 paper: "175B"; 174.6B in Narayanan et al. 2021 (Megatron)
    ("llama/llama2-7b", 6.738e9),   # meta-llama/Llama-2-7b-hf: 6,738,415,616
    ("llama/llama2-13b", 13.016e9),  # meta-llama/Llama-2-13b-hf: 13,015,864,320
    ("llama/llama2-70b", 68.98e9),   # meta-llama/Llama-2-70b-hf: 68,976,648,192
    ("llama/llama3-8b", 8.030e9),   # meta-llama/Meta-Llama-3-8B: 8,030,261,248
    ("llama/llama3-70b", 70.554e9),  # meta-llama/Meta-Llama-3-70B: 70,553,706,496
])
def test_presets_match_published_totals(name, published):
    assert count_parameters(preset(name)) == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("name, label", [("gpt/125m", 125e6), ("gpt/350m", 350e6), ("gpt/1.3b", 1.3e9),
                                         ("gpt/2.7b", 2.7e9), ("gpt/6.7b", 6.7e9), ("gpt/13b", 13e9)])
def test_gpt3_sizes_match_their_paper_labels(name, label):
    """GPT-3's Table 2.1 labels are rounded (the 1.3B model has 1.316B weights, 350M has 356M): within 2%."""
    assert count_parameters(preset(name)) == pytest.approx(label, rel=0.02)


def tiny_gpt2(vocab=1000, positions=64, hidden=64, layers=2, heads=4):
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=hidden, n_layer=layers,
                                     n_head=heads, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=positions,
                        vocab_size=vocab)
    return transformers.GPT2LMHeadModel(config), model


def tiny_llama(vocab=1000, tied=False, groups=2, head_dim=None, bias=False, ffn=96):
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=ffn, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=groups, head_dim=head_dim or 16, tie_word_embeddings=tied, attention_bias=bias,
        mlp_bias=bias, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                        kv_channels=head_dim, ffn_hidden_size=ffn, seq_length=64, vocab_size=vocab,
                        position_embedding="rope", norm="rmsnorm", activation="swiglu", bias=bias, tie_embeddings=tied)
    return transformers.LlamaForCausalLM(config), model


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # shared (tied) tensors are yielded once


def test_gpt2_parameter_count_matches_hf():
    hf, model = tiny_gpt2()
    assert count_parameters(model) == numel(hf)


@pytest.mark.parametrize("kwargs", [{}, {"tied": True}, {"groups": 4}, {"groups": 1}, {"head_dim": 32},
                                    {"bias": True}], ids=["gqa", "tied", "mha", "mqa", "head_dim", "bias"])
def test_llama_parameter_count_matches_hf(kwargs):
    hf, model = tiny_llama(**kwargs)
    assert count_parameters(model) == numel(hf)


def test_padded_vocab_counts_the_padded_rows():
    model = tiny_llama(vocab=1000)[1]
    padded = model.padded_vocab_size(2)  # 1024
    assert count_parameters(model, tp=2, padded_vocab=True) == numel(tiny_llama(vocab=padded)[0])
    assert count_parameters(model, tp=2) == count_parameters(model)  # tp only matters for padding


def measured_training_flops_per_token(hf: torch.nn.Module, batch: int, seq: int, vocab: int) -> float:
    """Matmul FLOPs of one forward + backward, counted by torch, per token."""
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        hf(input_ids=ids, labels=ids).loss.backward()
    return counter.get_total_flops() / (batch * seq)


def test_flops_match_torch_flop_counter_gpt2():
    hf, model = tiny_gpt2()
    assert flops_per_token(model, seq_length=32) == measured_training_flops_per_token(hf, 2, 32, 1000)


@pytest.mark.parametrize("kwargs", [{}, {"head_dim": 32}, {"tied": True}], ids=["gqa", "head_dim", "tied"])
def test_flops_match_torch_flop_counter_llama(kwargs):
    hf, model = tiny_llama(**kwargs)
    assert flops_per_token(model, seq_length=48) == measured_training_flops_per_token(hf, 2, 48, 1000)


def test_flops_match_megatron_formula_for_gpt3_175b():
    """Megatron-LM's per-batch count 72*B*s*L*h^2*(1 + s/(6h) + V/(12*h*L)), divided by B*s tokens."""
    m = preset("gpt/175b")
    L, h, s, V = m.num_layers, m.hidden_size, m.seq_length, m.vocab_size
    expected = 72 * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    assert flops_per_token(m) == pytest.approx(expected, rel=1e-12)
    assert flops_per_token(m, seq_length=4096) > flops_per_token(m)  # attention grows with the context
