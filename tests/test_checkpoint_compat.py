"""A checkpoint of another model is refused by name, whatever setting made it another model.

The check compares the tensors both configs' models store (names and full shapes, the models built on the
meta device), so no shape-changing setting can be left off a list: the MoE ones, which a hand-kept list
once missed, are refused like the others, and settings that change no tensor (the RoPE base, dropout,
vocabulary padding) are not."""
import dataclasses

import pytest

from megatron_domino.checkpoint_format import check_compatible
from megatron_domino.config.errors import CheckpointError
from megatron_domino.config.loader import config_to_dict, load_config
from tests.training_runs import REPO, TINY

BASE = load_config(f"{REPO}/{TINY['mixtral']}").model

SHAPED = [("num_layers", 2), ("hidden_size", 96), ("num_query_groups", 2),
          ("kv_channels", 16), ("vocab_size", 1000), ("tie_embeddings", True), ("bias", True),
          ("num_experts", 8), ("moe_ffn_hidden_size", 32), ("moe_shared_experts", 1), ("moe_layer_freq", 2),
          ("norm", "layernorm"), ("activation", "gelu"), ("position_embedding", "learned"), ("moe_router", "sigmoid")]
SAME = [("rope_base", 500000.0), ("attention_dropout", 0.1), ("make_vocab_size_divisible_by", 64), ("moe_topk", 1),
        ("moe_aux_loss_coeff", 0.0), ("recompute", "full"), ("attention_backend", "math"), ("init_std", 0.01),
        ("moe_capacity_factor", 1.25), ("moe_grouped_gemm", True), ("max_position_embeddings", 128),
        ("ffn_hidden_size", 192)]  # every layer of the tiny Mixtral is MoE: the dense FFN width sizes no tensor


def _saved(model):
    return {"config": config_to_dict(load_config(f"{REPO}/{TINY['mixtral']}")) | {"model": dataclasses.asdict(model)}}


@pytest.mark.parametrize("key, value", SHAPED, ids=[k for k, _ in SHAPED])
def test_a_checkpoint_of_another_model_is_refused_naming_the_setting(key, value):
    other = dataclasses.replace(BASE, **{key: value})
    with pytest.raises(CheckpointError, match=rf"model\.{key}: checkpoint {value!r} vs config"):
        check_compatible(_saved(other), BASE)


@pytest.mark.parametrize("key, value", SAME, ids=[k for k, _ in SAME])
def test_settings_that_change_no_tensor_load(key, value):
    check_compatible(_saved(dataclasses.replace(BASE, **{key: value})), BASE)
