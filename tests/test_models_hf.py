"""The tiny GPT and Llama against HF transformers with the same weights (fp32, sharpened random weights:
tests/hf_sharp.py; no download)."""
import pytest
import torch

from megatron_domino.config import ModelConfig
from megatron_domino.convert.hf_mapping import hf_to_native, native_to_hf
from megatron_domino.models import LanguageModel, full_state_dict, load_full_state_dict
from tests.hf_sharp import assert_logits_close, sharpen

transformers = pytest.importorskip("transformers")

GPT = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32,
                  vocab_size=1000, activation="gelu_tanh", norm="layernorm", position_embedding="learned")
LLAMA = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
                    seq_length=32, vocab_size=1000, activation="swiglu", norm="rmsnorm", norm_eps=1e-5, bias=False,
                    position_embedding="rope", rope_base=500000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                    rope_high_freq_factor=4.0, rope_original_max_position=16, tie_embeddings=False)


def _hf_gpt2(cfg):
    config = transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.seq_length, n_embd=cfg.hidden_size,
                                     n_layer=cfg.num_layers, n_head=cfg.num_attention_heads, n_inner=cfg.ffn_size,
                                     activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _hf_llama(cfg):
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.query_groups, max_position_embeddings=cfg.seq_length, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": cfg.rope_base, "factor": cfg.rope_scaling_factor,
                         "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                         "original_max_position_embeddings": cfg.rope_original_max_position})
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("cfg, build, kind", [(GPT, _hf_gpt2, "gpt2"), (LLAMA, _hf_llama, "llama")],
                         ids=["gpt2", "llama"])
def test_logits_match_transformers(cfg, build, kind):
    torch.manual_seed(0)
    hf = sharpen(build(cfg).eval(), seed=1)
    native = hf_to_native(hf.state_dict(), cfg, kind)
    model = LanguageModel(cfg).eval()
    load_full_state_dict(model, native)
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length))
    with torch.no_grad():
        expected = hf(tokens).logits
        ours = model.logits(None, {"tokens": tokens})
    assert_logits_close(ours, expected)
    back = native_to_hf(full_state_dict(model), cfg, kind)
    for name, tensor in hf.state_dict().items():
        if name in back:
            assert torch.equal(back[name], tensor), name
    assert set(back) >= {n for n in hf.state_dict() if "attn.bias" not in n and "masked_bias" not in n}


def test_grouped_query_attention_hands_sdpa_uncopied_keys_and_values():
    """GQA: SDPA gets K and V with one head per group (``enable_gqa``), never a copy per query head."""
    from torch.overrides import TorchFunctionMode

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.kv_heads, self.repeats = [], 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name == "scaled_dot_product_attention":
                self.kv_heads.append((args[0].shape[1], args[1].shape[1], args[2].shape[1]))
            self.repeats += name == "repeat_interleave"
            return func(*args, **(kwargs or {}))

    model = LanguageModel(LLAMA)
    with Calls() as calls:
        model.logits(None, {"tokens": torch.randint(0, LLAMA.vocab_size, (2, LLAMA.seq_length))})
    assert calls.kv_heads == [(LLAMA.num_attention_heads, LLAMA.query_groups, LLAMA.query_groups)] * LLAMA.num_layers
    assert calls.repeats == 0
