"""tools/convert_checkpoint.py: HF <-> native round trips (GPT-2, Llama, Mixtral), logits against transformers,
reshard, a version-1 checkpoint refused (the HF config's spellings: test_convert_config.py).

Tiny random HF models are built from configs and saved locally (one file, and sharded with an index);
nothing is downloaded. References are transformers itself and the HF files as saved by transformers.
"""
import json
import os
import shutil
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron_domino import checkpoint_format as fmt
from megatron_domino.checkpoint_format import resolve_load_path, tensors
from megatron_domino.config import ConfigError, config_to_dict, load_config
from megatron_domino.config.errors import CheckpointError
from megatron_domino.convert.convert import hf_to_native, native_to_hf, reshard
from megatron_domino.convert.hf_config import hf_config_from_model, model_config_from_hf
from megatron_domino.convert.native_io import NativeTensors
from megatron_domino.models import LanguageModel, full_state_dict
from megatron_domino.parallel.random import RNGTracker
from megatron_domino.parallel.store_barrier import StoreBarriers
from megatron_domino.training.checkpoint import Checkpointer
from tests.hf_sharp import assert_logits_close, sharpen
from tests.test_convert_config import LLAMA3_ROPE
from tests.tools import load_tool

transformers = pytest.importorskip("transformers")
_CLI = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "convert_checkpoint.py")
cli = load_tool("convert_checkpoint")



def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=64, n_layer=4, n_head=4,
                                     activation_function="gelu_new", bos_token_id=0, eos_token_id=0)
    return sharpen(transformers.GPT2LMHeadModel(config).eval(), seed=10)


def _llama(tied=False, bias=False):
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        attention_bias=bias, mlp_bias=bias, bos_token_id=0, eos_token_id=0,
        rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE})
    return sharpen(transformers.LlamaForCausalLM(config).eval(), seed=11)  # biases too: HF starts them at zero


def _mixtral(**overrides):
    torch.manual_seed(2)
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        router_aux_loss_coef=0.02, bos_token_id=0, eos_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **overrides)
    return sharpen(transformers.MixtralForCausalLM(config).eval(), seed=12)


def _qwen(kind: str):
    """Tiny Qwen2 (q/k/v biases, tied), Qwen3 (QK-norm, head_dim 16 != hidden / heads) and Qwen3-MoE (4 experts of
    which 2 per token, gates left unnormalised, layer 1 dense through mlp_only_layers)."""
    torch.manual_seed(3)
    common = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}, sliding_window=None)
    if kind == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        return sharpen(transformers.Qwen2ForCausalLM(config), seed=13).eval()
    if kind == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
        return sharpen(transformers.Qwen3ForCausalLM(config), seed=14).eval()
    config = transformers.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=24, norm_topk_prob=False, mlp_only_layers=[1],
                                         router_aux_loss_coef=0.02, tie_word_embeddings=False)
    return sharpen(transformers.Qwen3MoeForCausalLM(config), seed=15).eval()


QWEN = ("qwen2", "qwen3", "qwen3_moe")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (HF model, saved directory): GPT-2 in one file, Llama (GQA, untied, Llama-3.1 RoPE scaling)
    sharded with an index json, a tied Llama with biases, and Mixtral (4 experts, top-2), whose saved hub
    layout (block_sparse_moe.experts.E.w1/w2/w3) differs from transformers 5's fused in-memory experts."""
    root = tmp_path_factory.mktemp("hf")
    gpt2, llama, llama_tied, mixtral = _gpt2(), _llama(), _llama(tied=True, bias=True), _mixtral()
    gpt2.save_pretrained(root / "gpt2", safe_serialization=True)
    llama.save_pretrained(root / "llama", safe_serialization=True, max_shard_size="100KB")
    llama_tied.save_pretrained(root / "llama_tied_bias", safe_serialization=True)
    mixtral.save_pretrained(root / "mixtral", safe_serialization=True)
    assert os.path.exists(root / "llama" / "model.safetensors.index.json")
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in _file_keys(root / "mixtral" / "model.safetensors")
    models = {"gpt2": (gpt2, str(root / "gpt2")), "llama": (llama, str(root / "llama")),
              "llama_tied_bias": (llama_tied, str(root / "llama_tied_bias")),
              "mixtral": (mixtral, str(root / "mixtral"))}
    for kind in QWEN:
        model = _qwen(kind).eval()
        model.save_pretrained(root / kind, safe_serialization=True)
        models[kind] = (model, str(root / kind))
    return models


def _hf_tensors(hf_dir):
    """Every tensor of an HF directory, from whichever files hold it."""
    out = {}
    for name in os.listdir(hf_dir):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(hf_dir, name)))
    return out


def _file_keys(path):
    with safe_open(path, framework="pt") as f:
        return set(f.keys())


def _native_tensors(root):
    """Every stored weight of a native checkpoint root, by name."""
    source = NativeTensors(resolve_load_path(root, None))
    return {name: source.get(name) for name in source.keys()}


def _load_into(model, path, cfg):
    """Load ``path`` into a tp=1 single-stage ``model`` with the training loader itself; returns the metadata."""
    state = SimpleNamespace(tp_rank=0, tp_size=1, cp_size=1, pp_size=1, dp_size=1, virtual_pp=1, rank=0,
                            barriers=StoreBarriers("test"))
    return Checkpointer(cfg, state, RNGTracker()).load(path, chunks=[model], optimizer=None, lr_schedule=None)


def _load_native(root, model_cfg):
    """A tp=1 single-stage model filled by the training loader itself from the converted checkpoint."""
    model = LanguageModel(model_cfg).eval()
    cfg = load_config(os.path.join(root, "config.yaml"), ["parallel.tp=1", "parallel.pp=1"])
    metadata = _load_into(model, resolve_load_path(cfg.checkpoint.load, None), cfg)
    assert metadata["step"] == 0 and metadata["has_optimizer"] is False
    return model


@pytest.mark.parametrize("name", ["gpt2", "llama", "llama_tied_bias", "mixtral", *QWEN])
def test_round_trip_is_bit_exact_and_logits_match(hf_models, tmp_path, name):
    hf_model, hf_dir = hf_models[name]
    kind = name if name in QWEN else name.split("_")[0]
    native = str(tmp_path / "native")
    assert cli.main(["hf-to-native", "--model", kind, "--input", hf_dir, "--output", native,
                     "--tp", "2", "--pp", "2", "--quiet"]) == 0
    step = os.path.join(native, "step_00000000")
    with open(os.path.join(step, "metadata.json")) as f:
        meta = json.load(f)
    assert meta["layout"] == {"tp": 2, "cp": 1, "pp": 2, "dp": None, "virtual_pp": 1, "zero_stage": None}
    assert meta["has_optimizer"] is False and meta["config"]["parallel"]["tp"] == 2
    # layout-free: every weight stored whole, once, under its global name
    index = tensors.read_index(step)
    stored = {n.removeprefix("model/"): md for n, md in index.state_dict_metadata.items()}
    layers = hf_model.config.num_hidden_layers if kind != "gpt2" else hf_model.config.n_layer
    assert {n.split(".")[1] for n in stored if n.startswith("layers.")} == {str(i) for i in range(layers)}
    assert all(len(md.chunks) == 1 and tuple(md.chunks[0].sizes) == tuple(md.size) for md in stored.values())
    assert "embedding.word_embeddings.weight" in stored and "final_norm.weight" in stored
    tied = name in ("gpt2", "llama_tied_bias", "qwen2")
    assert ("output_layer.weight" in stored) == (not tied)  # a tied head: the embedding, once
    assert ("layers.0.attention.qkv.bias" in stored) == (name in ("gpt2", "llama_tied_bias", "qwen2"))
    assert ("layers.0.attention.proj.bias" in stored) == (name in ("gpt2", "llama_tied_bias"))
    assert ("layers.0.attention.q_norm.weight" in stored) == (name in ("qwen3", "qwen3_moe"))
    assert ("layers.0.mlp.experts.3.fc1.weight" in stored) == (name in ("mixtral", "qwen3_moe"))
    assert ("layers.1.mlp.experts.3.fc1.weight" in stored) == (name == "mixtral")  # Qwen3-MoE's layer 1 is dense

    cfg = load_config(os.path.join(native, "config.yaml"))
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.checkpoint.load) == (2, 2, os.path.abspath(native))
    model = _load_native(native, cfg.model)
    tokens = torch.randint(0, hf_model.config.vocab_size, (2, cfg.model.seq_length))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        ours = model.logits(None, {"tokens": tokens})
    assert_logits_close(ours, expected)

    back = str(tmp_path / "back")
    native_to_hf(native, back, max_shard_size="60KB", quiet=True)
    assert os.path.exists(os.path.join(back, "model.safetensors.index.json"))
    original, exported = _hf_tensors(hf_dir), _hf_tensors(back)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    with open(os.path.join(back, "config.json")) as f:
        out_cfg = json.load(f)
    with open(os.path.join(hf_dir, "config.json")) as f:
        in_cfg = json.load(f)
    for key, value in out_cfg.items():
        if in_cfg.get(key) is not None and key not in ("transformers_version", "torch_dtype"):
            assert in_cfg[key] == value, key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back, local_files_only=True).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, expected)


def test_single_file_export_omits_tied_head(hf_models, tmp_path):
    native, back = str(tmp_path / "native"), str(tmp_path / "back")
    hf_to_native(hf_models["gpt2"][1], native, tp=1, pp=1, quiet=True)
    native_to_hf(native, back, quiet=True)
    assert sorted(f for f in os.listdir(back) if "safetensors" in f) == ["model.safetensors"]
    assert "lm_head.weight" not in _file_keys(os.path.join(back, "model.safetensors"))


def test_gpt2_files_without_transformer_prefix(hf_models, tmp_path):
    """GPT-2 weights saved from GPT2Model name 'h.0.ln_1.weight', not 'transformer.h.0.ln_1.weight'."""
    hf_dir = hf_models["gpt2"][1]
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(hf_dir, "config.json"), bare / "config.json")
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, str(bare / "model.safetensors"))
    hf_to_native(str(bare), str(tmp_path / "a"), quiet=True)
    hf_to_native(hf_dir, str(tmp_path / "b"), quiet=True)
    a, b = _native_tensors(str(tmp_path / "a")), _native_tensors(str(tmp_path / "b"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)


def test_reshard_retargets_the_layout_and_copies_the_tensors(hf_models, tmp_path):
    native, again = str(tmp_path / "native"), str(tmp_path / "tp1pp4")
    hf_to_native(hf_models["llama"][1], native, tp=2, pp=2, quiet=True)
    reshard(native, again, tp=1, pp=4, quiet=True)
    with open(os.path.join(again, "step_00000000", "metadata.json")) as f:
        meta = json.load(f)
    assert (meta["layout"]["tp"], meta["layout"]["pp"]) == (1, 4)
    assert (meta["config"]["parallel"]["tp"], meta["config"]["parallel"]["pp"]) == (1, 4)
    weights, moved = _native_tensors(native), _native_tensors(again)
    assert set(moved) == set(weights) and all(torch.equal(moved[n], t) for n, t in weights.items())


def test_a_version_1_checkpoint_is_refused_naming_the_commit_that_upgrades_it(tmp_path):
    """The old full-tensor safetensors layout is refused, and the error names the converter that reads it."""
    cfg = load_config(os.path.join(os.path.dirname(_CLI), os.pardir, "configs", "tiny", "llama.yaml"))
    model = LanguageModel(cfg.model)
    old = tmp_path / "old" / "step_00000007"
    old.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in full_state_dict(model).items()}, str(old / "model-pp000.safetensors"))
    meta = {**fmt.metadata(7, config_to_dict(cfg), fmt.layout(1, 1, 1, 1, 1)), "version": 1}
    (old / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"version-1 checkpoint .* Fix: upgrade it with the converter of commit "
                                              r"7c22769 .*convert_checkpoint.py upgrade --input"):
        _load_into(LanguageModel(cfg.model), str(old), cfg)


def test_mixtral_experts_land_in_order_and_its_config_maps_both_ways(hf_models, tmp_path):
    """Expert E's fc1 is its w1 (gate) rows then its w3 (up) rows, fc2 its w2; the MoE settings map both ways."""
    hf_dir = hf_models["mixtral"][1]
    hf_to_native(hf_dir, str(tmp_path / "native"), quiet=True)
    hf, native = _hf_tensors(hf_dir), _native_tensors(str(tmp_path / "native"))
    theirs = "model.layers.1.block_sparse_moe."
    assert torch.equal(native["layers.1.mlp.router.weight"], hf[theirs + "gate.weight"])
    for e in range(4):
        fc1 = torch.cat([hf[f"{theirs}experts.{e}.w1.weight"], hf[f"{theirs}experts.{e}.w3.weight"]])
        assert torch.equal(native[f"layers.1.mlp.experts.{e}.fc1.weight"], fc1)
        assert torch.equal(native[f"layers.1.mlp.experts.{e}.fc2.weight"], hf[f"{theirs}experts.{e}.w2.weight"])
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = model_config_from_hf(json.load(f))
    assert (cfg.num_experts, cfg.moe_topk, cfg.moe_ffn_size, cfg.moe_router, cfg.moe_capacity_factor,
            cfg.moe_aux_loss_coeff, cfg.rope_base, cfg.norm_eps) == (4, 2, 48, "softmax", None, 0.02, 1e6, 1e-5)
    back = hf_config_from_model(cfg, "float32")
    assert (back["num_local_experts"], back["num_experts_per_tok"], back["intermediate_size"],
            back["router_aux_loss_coef"], back["sliding_window"]) == (4, 2, 48, 0.02, None)
    with pytest.raises(ValueError, match="moe_router=sigmoid"):
        hf_config_from_model(replace(cfg, moe_router="sigmoid"), "float32")
    # at ep 2 the same layout-free tensors, and a config that runs on ep data-parallel ranks; ep 3 is refused
    hf_to_native(hf_dir, str(tmp_path / "ep2"), ep=2, quiet=True)
    at_ep2 = _native_tensors(str(tmp_path / "ep2"))
    assert at_ep2.keys() == native.keys() and all(torch.equal(at_ep2[n], native[n]) for n in native)
    assert load_config(str(tmp_path / "ep2" / "config.yaml")).parallel.ep == 2
    with pytest.raises(ConfigError, match="parallel.ep = 3: must divide model.num_experts = 4"):
        hf_to_native(hf_dir, str(tmp_path / "ep3"), ep=3, quiet=True)


def test_mixtral_sliding_window_shorter_than_the_sequence_is_refused(tmp_path):
    windowed = tmp_path / "windowed"
    _mixtral(sliding_window=8).save_pretrained(windowed, safe_serialization=True)
    with pytest.raises(ValueError, match=r"sliding_window = 8: is shorter than the sequence length 16.*"
                                         r"Fix: convert with --seq-length 8 or less"):
        hf_to_native(str(windowed), str(tmp_path / "out"), quiet=True)
    hf_to_native(str(windowed), str(tmp_path / "short"), seq_length=8, quiet=True)
    assert load_config(str(tmp_path / "short" / "config.yaml")).model.seq_length == 8


def test_errors_name_the_problem(hf_models, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        hf_to_native(str(tmp_path), str(tmp_path / "out"), quiet=True)
    odd = tmp_path / "mistral"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    with pytest.raises(ValueError, match="model_type = 'mistral'.*not a supported model type"):
        hf_to_native(str(odd), str(tmp_path / "out"), quiet=True)
    with pytest.raises(ValueError, match="differs from --model gpt2"):
        hf_to_native(hf_models["llama"][1], str(tmp_path / "out"), model="gpt2", quiet=True)
    with pytest.raises(ConfigError, match="parallel.tp"):  # 8 heads, 2 KV groups: tp 3 cannot split them
        hf_to_native(hf_models["llama"][1], str(tmp_path / "out"), tp=3, quiet=True)
    no_weights = tmp_path / "no_weights"
    shutil.copytree(hf_models["gpt2"][1], no_weights)
    os.remove(no_weights / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        hf_to_native(str(no_weights), str(tmp_path / "out"), quiet=True)
