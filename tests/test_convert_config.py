"""The HF config as tools/convert_checkpoint.py reads it: transformers 4's and 5's RoPE spellings agree."""
import pytest

from megatron_domino.convert.hf_config import model_config_from_hf

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def test_rope_scaling_and_rope_parameters_spellings_agree():
    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 128,
            "vocab_size": 300, "rms_norm_eps": 1e-5}
    v4 = {**base, "rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_ROPE)}
    v5 = {**base, "rope_parameters": {"rope_theta": 500000.0, **LLAMA3_ROPE}}
    assert model_config_from_hf(v4) == model_config_from_hf(v5)
    cfg = model_config_from_hf(v5)
    assert (cfg.rope_base, cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
            cfg.rope_original_max_position) == (500000.0, 8.0, 1.0, 4.0, 16)
    assert (cfg.query_groups, cfg.ffn_size, cfg.tie_embeddings, cfg.bias, cfg.seq_length) == (2, 96, False, False, 16)
    llama2 = model_config_from_hf({**base, "rope_theta": 10000.0, "rope_scaling": None})
    assert llama2.rope_scaling_factor is None and llama2.rope_base == 10000.0 and llama2.seq_length == 128
    with pytest.raises(ValueError, match="rope_scaling.rope_type = 'dynamic'"):
        model_config_from_hf({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    yarn = model_config_from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert (yarn.rope_scaling_type, yarn.rope_scaling_factor, yarn.rope_original_max_position) == ("yarn", 4.0, 128)
    odd_head = model_config_from_hf({**base, "head_dim": 16})
    assert odd_head.kv_channels == 16 and odd_head.head_dim == 16
