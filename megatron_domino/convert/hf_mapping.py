"""Tensor-by-tensor mapping between HF GPT-2 / Llama / Mixtral / Qwen2 / Qwen3 / Qwen3-MoE names and native global
names.

Native full-size tensors use the grouped QKV layout (per KV group: its query heads, its key
head, its value head), so a TP slice is a run of whole groups. Every function here works on
one layer at a time, so conversions can stream tensor by tensor.
"""
from __future__ import annotations

import torch

from .deepseek_v3 import (deepseek_v3_layer_to_native, deepseek_v3_mtp_to_native, native_layer_to_deepseek_v3,
                          native_mtp_to_deepseek_v3)
from .hf_experts import (MIXTRAL_EXPERTS, QWEN3_MOE_EXPERTS, experts_to_hf, experts_to_native, swiglu_to_hf,
                         swiglu_to_native)


def _grouped_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Separate q [heads*d, ...], k, v [groups*d, ...] -> grouped [(heads + 2 groups) * d, ...]."""
    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)
    k, v = k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_grouped_qkv(qkv: torch.Tensor, heads: int, groups: int, head_dim: int):
    rest = qkv.shape[1:]
    per_group = qkv.reshape(groups, (heads // groups + 2) * head_dim, *rest)
    q_rows = heads // groups * head_dim
    q = per_group[:, :q_rows].reshape(heads * head_dim, *rest)
    k = per_group[:, q_rows:q_rows + head_dim].reshape(groups * head_dim, *rest)
    v = per_group[:, q_rows + head_dim:].reshape(groups * head_dim, *rest)
    return q, k, v


def gpt2_layer_to_native(hf: dict, i: int, cfg) -> dict:
    """One GPT-2 block (Conv1D weights are [in, out]) -> native names."""
    p, n = f"transformer.h.{i}.", f"layers.{i}."
    heads = cfg.num_attention_heads
    c_attn_w, c_attn_b = hf[p + "attn.c_attn.weight"].t(), hf[p + "attn.c_attn.bias"]
    q, k, v = c_attn_w.chunk(3, dim=0)
    qb, kb, vb = c_attn_b.chunk(3, dim=0)
    return {
        n + "input_norm.weight": hf[p + "ln_1.weight"], n + "input_norm.bias": hf[p + "ln_1.bias"],
        n + "attention.qkv.weight": _grouped_qkv(q, k, v, heads),
        n + "attention.qkv.bias": _grouped_qkv(qb, kb, vb, heads),
        n + "attention.proj.weight": hf[p + "attn.c_proj.weight"].t(),
        n + "attention.proj.bias": hf[p + "attn.c_proj.bias"],
        n + "post_attention_norm.weight": hf[p + "ln_2.weight"], n + "post_attention_norm.bias": hf[p + "ln_2.bias"],
        n + "mlp.fc1.weight": hf[p + "mlp.c_fc.weight"].t(), n + "mlp.fc1.bias": hf[p + "mlp.c_fc.bias"],
        n + "mlp.fc2.weight": hf[p + "mlp.c_proj.weight"].t(), n + "mlp.fc2.bias": hf[p + "mlp.c_proj.bias"],
    }


def native_layer_to_gpt2(native: dict, i: int, cfg) -> dict:
    p, n = f"transformer.h.{i}.", f"layers.{i}."
    heads, d = cfg.num_attention_heads, cfg.head_dim
    q, k, v = _split_grouped_qkv(native[n + "attention.qkv.weight"], heads, heads, d)
    qb, kb, vb = _split_grouped_qkv(native[n + "attention.qkv.bias"], heads, heads, d)
    return {
        p + "ln_1.weight": native[n + "input_norm.weight"], p + "ln_1.bias": native[n + "input_norm.bias"],
        p + "attn.c_attn.weight": torch.cat([q, k, v]).t().contiguous(), p + "attn.c_attn.bias": torch.cat([qb, kb, vb]),
        p + "attn.c_proj.weight": native[n + "attention.proj.weight"].t().contiguous(),
        p + "attn.c_proj.bias": native[n + "attention.proj.bias"],
        p + "ln_2.weight": native[n + "post_attention_norm.weight"],
        p + "ln_2.bias": native[n + "post_attention_norm.bias"],
        p + "mlp.c_fc.weight": native[n + "mlp.fc1.weight"].t().contiguous(), p + "mlp.c_fc.bias": native[n + "mlp.fc1.bias"],
        p + "mlp.c_proj.weight": native[n + "mlp.fc2.weight"].t().contiguous(),
        p + "mlp.c_proj.bias": native[n + "mlp.fc2.bias"],
    }


def _llama_attention_to_native(hf: dict, p: str, n: str, cfg) -> dict:
    """The norms and attention of a Llama-style layer (Llama and Mixtral share them)."""
    out = {
        n + "input_norm.weight": hf[p + "input_layernorm.weight"],
        n + "attention.qkv.weight": _grouped_qkv(hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"],
                                                 hf[p + "self_attn.v_proj.weight"], cfg.query_groups),
        n + "attention.proj.weight": hf[p + "self_attn.o_proj.weight"],
        n + "post_attention_norm.weight": hf[p + "post_attention_layernorm.weight"],
    }
    if cfg.has_qkv_bias:  # Llama with biases; Qwen2's q/k/v
        out[n + "attention.qkv.bias"] = _grouped_qkv(hf[p + "self_attn.q_proj.bias"], hf[p + "self_attn.k_proj.bias"],
                                                     hf[p + "self_attn.v_proj.bias"], cfg.query_groups)
    if cfg.bias:
        out[n + "attention.proj.bias"] = hf[p + "self_attn.o_proj.bias"]
    if cfg.qk_norm:  # Qwen3
        out.update({n + "attention.q_norm.weight": hf[p + "self_attn.q_norm.weight"],
                    n + "attention.k_norm.weight": hf[p + "self_attn.k_norm.weight"]})
    return out


def _native_attention_to_llama(native: dict, p: str, n: str, cfg) -> dict:
    heads, groups, d = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
    q, k, v = _split_grouped_qkv(native[n + "attention.qkv.weight"], heads, groups, d)
    out = {
        p + "input_layernorm.weight": native[n + "input_norm.weight"],
        p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
        p + "self_attn.o_proj.weight": native[n + "attention.proj.weight"],
        p + "post_attention_layernorm.weight": native[n + "post_attention_norm.weight"],
    }
    if cfg.has_qkv_bias:
        qb, kb, vb = _split_grouped_qkv(native[n + "attention.qkv.bias"], heads, groups, d)
        out.update({p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb, p + "self_attn.v_proj.bias": vb})
    if cfg.bias:
        out[p + "self_attn.o_proj.bias"] = native[n + "attention.proj.bias"]
    if cfg.qk_norm:
        out.update({p + "self_attn.q_norm.weight": native[n + "attention.q_norm.weight"],
                    p + "self_attn.k_norm.weight": native[n + "attention.k_norm.weight"]})
    return out


def _kinds(cfg) -> tuple:
    return ("weight", "bias") if cfg.bias else ("weight",)


def llama_layer_to_native(hf: dict, i: int, cfg) -> dict:
    p, n = f"model.layers.{i}.", f"layers.{i}."
    mlp = swiglu_to_native(hf, n + "mlp.", p + "mlp.gate_proj", p + "mlp.up_proj", p + "mlp.down_proj", _kinds(cfg))
    return {**_llama_attention_to_native(hf, p, n, cfg), **mlp}


def native_layer_to_llama(native: dict, i: int, cfg) -> dict:
    p, n = f"model.layers.{i}.", f"layers.{i}."
    mlp = swiglu_to_hf(native, n + "mlp.", p + "mlp.gate_proj", p + "mlp.up_proj", p + "mlp.down_proj", _kinds(cfg))
    return {**_native_attention_to_llama(native, p, n, cfg), **mlp}


def _moe_layer_to_native(hf: dict, i: int, cfg, names: tuple) -> dict:
    """Llama's attention, HF's router and experts."""
    p, n = f"model.layers.{i}.", f"layers.{i}."
    return {**_llama_attention_to_native(hf, p, n, cfg), **experts_to_native(hf, p, n, cfg, names)}


def _native_moe_layer_to_hf(native: dict, i: int, cfg, names: tuple) -> dict:
    p, n = f"model.layers.{i}.", f"layers.{i}."
    return {**_native_attention_to_llama(native, p, n, cfg), **experts_to_hf(native, p, n, cfg, names)}


def mixtral_layer_to_native(hf: dict, i: int, cfg) -> dict:
    return _moe_layer_to_native(hf, i, cfg, MIXTRAL_EXPERTS)


def native_layer_to_mixtral(native: dict, i: int, cfg) -> dict:
    return _native_moe_layer_to_hf(native, i, cfg, MIXTRAL_EXPERTS)


def qwen3_moe_layer_to_native(hf: dict, i: int, cfg) -> dict:
    """Qwen3's attention; an MoE layer's experts, or a dense layer's MLP (``mlp_only_layers``) as Llama's."""
    if not cfg.is_moe_layer(i):
        return llama_layer_to_native(hf, i, cfg)
    return _moe_layer_to_native(hf, i, cfg, QWEN3_MOE_EXPERTS)


def native_layer_to_qwen3_moe(native: dict, i: int, cfg) -> dict:
    if not cfg.is_moe_layer(i):
        return native_layer_to_llama(native, i, cfg)
    return _native_moe_layer_to_hf(native, i, cfg, QWEN3_MOE_EXPERTS)


# Non-layer tensors: native name -> HF name.
GPT2_GLOBALS = {
    "embedding.word_embeddings.weight": "transformer.wte.weight",
    "embedding.position_embeddings.weight": "transformer.wpe.weight",
    "final_norm.weight": "transformer.ln_f.weight",
    "final_norm.bias": "transformer.ln_f.bias",
    "output_layer.weight": "lm_head.weight",
}
LLAMA_GLOBALS = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
LAYER_TO_NATIVE = {"gpt2": gpt2_layer_to_native, "llama": llama_layer_to_native, "mixtral": mixtral_layer_to_native,
                   "qwen2": llama_layer_to_native, "qwen3": llama_layer_to_native,
                   "qwen3_moe": qwen3_moe_layer_to_native}
LAYER_TO_HF = {"gpt2": native_layer_to_gpt2, "llama": native_layer_to_llama, "mixtral": native_layer_to_mixtral,
               "qwen2": native_layer_to_llama, "qwen3": native_layer_to_llama, "qwen3_moe": native_layer_to_qwen3_moe}
LAYER_TO_NATIVE["deepseek_v3"], LAYER_TO_HF["deepseek_v3"] = deepseek_v3_layer_to_native, native_layer_to_deepseek_v3
GLOBALS = {"gpt2": GPT2_GLOBALS, **{kind: LLAMA_GLOBALS for kind in LAYER_TO_HF if kind != "gpt2"}}
# Conversion groups, in model order: the embedding ("pre"), each layer index, each MTP module ("mtp.<k>"), then
# norm and head ("post").
PRE, POST, MTP = "pre", "post", "mtp."
MTP_TO_NATIVE, MTP_TO_HF = {"deepseek_v3": deepseek_v3_mtp_to_native}, {"deepseek_v3": native_mtp_to_deepseek_v3}


def groups(cfg) -> list:
    """Every conversion group of a model: converting one group needs only that group's tensors (MTP's export also
    reads the embedding and head, whose copies the hub files hold)."""
    return [PRE, *range(cfg.num_layers), *(f"{MTP}{k}" for k in range(cfg.mtp_num_layers)), POST]


def group_of(native_name: str):
    """The group holding a native tensor (a layer index, an MTP module, PRE or POST)."""
    if native_name.startswith("layers."):
        return int(native_name.split(".", 2)[1])
    if native_name.startswith("mtp.layers."):
        return MTP + native_name.split(".", 3)[2]
    return PRE if native_name.startswith("embedding.") else POST


def _global_names(cfg, model_type: str, group) -> dict:
    """native -> HF names of a non-layer group's tensors; a tied model has no output_layer of its own."""
    return {ours: theirs for ours, theirs in GLOBALS[model_type].items()
            if group_of(ours) == group and not (cfg.tie_embeddings and ours == "output_layer.weight")}


def hf_group_to_native(hf, group, cfg, model_type: str) -> dict:
    """One group of an HF state dict (any mapping name -> tensor) -> native names."""
    if group in (PRE, POST):
        return {ours: hf[theirs] for ours, theirs in _global_names(cfg, model_type, group).items() if theirs in hf}
    if isinstance(group, str):
        return MTP_TO_NATIVE[model_type](hf, int(group[len(MTP):]), cfg)
    return LAYER_TO_NATIVE[model_type](hf, group, cfg)


def native_group_to_hf(native, group, cfg, model_type: str) -> dict:
    """One group of a native state dict -> HF names (a tied head is not listed: HF files omit it)."""
    if group in (PRE, POST):
        return {theirs: native[ours] for ours, theirs in _global_names(cfg, model_type, group).items()
                if ours in native}
    if isinstance(group, str):
        return MTP_TO_HF[model_type](native, int(group[len(MTP):]), cfg)
    return LAYER_TO_HF[model_type](native, group, cfg)


def hf_to_native(hf: dict, cfg, model_type: str) -> dict:
    """Whole HF state dict -> native full-size state dict (global names)."""
    native = {}
    for group in groups(cfg):
        native.update(hf_group_to_native(hf, group, cfg, model_type))
    return native


def native_to_hf(native: dict, cfg, model_type: str) -> dict:
    """Whole native state dict -> HF state dict; a tied head is listed under its own name, as HF state dicts do."""
    hf = {}
    for group in groups(cfg):
        hf.update(native_group_to_hf(native, group, cfg, model_type))
    if cfg.tie_embeddings:
        hf["lm_head.weight"] = native["embedding.word_embeddings.weight"]
    return hf
