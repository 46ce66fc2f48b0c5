"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) <-> native: its config.json and its layers, tensor by tensor.

Attention is MLA (``models.mla``): HF's q_a_proj and kv_a_proj_with_mqa are the rows of our one ``down``
projection (query latent first), q_b_proj / q_proj, kv_b_proj and o_proj our ``q_up`` / ``q_proj``, ``kv_up`` and
``proj``. DeepSeek's weights lay each RoPE part out in interleaved pairs (``rope_interleave``, the hub's layout); ours
rotate halves, so the RoPE rows are de-interleaved on the way in and interleaved on the way out (a permutation: the
attention scores, and a round trip, are exact). The first ``first_k_dense_replace`` layers have Llama's MLP; the rest
route with sigmoid scores, ``e_score_correction_bias`` (our ``expert_bias``), groups and the routed scaling, plus
the shared experts. The multi-token-prediction modules (``models.mtp``) are the hub files' layers after the last one
(``num_nextn_predict_layers``): enorm, hnorm, eh_proj, a layer, shared_head.norm, and copies of the embedding and
the head, which ours share (written out on export, not read in); a checkpoint without those tensors (as
transformers saves it: it does not run them) converts without MTP.
DeepSeek-V3's sequence-wise balance loss is not carried (its weight is not in config.json): ``moe_aux_loss_coeff``
is 0 and the expert bias balances, updated at DeepSeek's rate 1e-3.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from .hf_experts import QWEN3_MOE_EXPERTS, experts_to_hf, experts_to_native, swiglu_to_hf, swiglu_to_native
from .hf_rope import _unsupported, hf_rope, rope_settings

BIAS_UPDATE_RATE = 1e-3  # DeepSeek-V3's bias update speed (gamma in its report)


def deepseek_v3_model(hf: dict) -> ModelConfig:
    """``ModelConfig`` of a DeepSeek-V3 config.json."""
    checks = {"hidden_act": (hf.get("hidden_act", "silu"), "silu"), "attention_bias": (hf.get("attention_bias"),
              False), "rope_interleave": (hf.get("rope_interleave", True), True),
              "num_key_value_heads": (hf.get("num_key_value_heads") or hf["num_attention_heads"],
                                      hf["num_attention_heads"])}
    for key, (value, wanted) in checks.items():
        if bool(value) != bool(wanted) if isinstance(wanted, bool) else value != wanted:
            raise _unsupported(key, value, f"must be {wanted} for DeepSeek-V3's MLA", "convert a standard DeepSeek-V3")
    rope = rope_settings(hf)
    positions = hf.get("max_position_embeddings", 4096)
    seq_length = rope["rope_original_max_position"] if "rope_scaling_factor" in rope else positions
    n_group = hf.get("n_group") or 1
    return ModelConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"], seq_length=min(seq_length, positions),
        max_position_embeddings=positions, vocab_size=hf["vocab_size"], position_embedding="rope", norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6), activation="swiglu", bias=False,
        tie_embeddings=hf.get("tie_word_embeddings", False), attention_dropout=hf.get("attention_dropout", 0.0),
        hidden_dropout=0.0, init_std=hf.get("initializer_range", 0.02), make_vocab_size_divisible_by=128,
        multi_latent_attention=True, kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=hf.get("q_lora_rank"),
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"], num_experts=hf["n_routed_experts"], moe_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_router="sigmoid",
        moe_norm_topk_prob=bool(hf.get("norm_topk_prob", True)), moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0,
        moe_shared_experts=hf.get("n_shared_experts") or 0, moe_first_k_dense=hf.get("first_k_dense_replace") or 0,
        moe_n_group=n_group if n_group > 1 else None, moe_topk_group=hf.get("topk_group") if n_group > 1 else None,
        moe_routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        moe_router_bias_update_rate=BIAS_UPDATE_RATE, **rope)


def deepseek_v3_hf_config(cfg: ModelConfig) -> dict:
    """config.json's model keys for a native DeepSeek-V3-shaped model (``is_deepseek_v3``)."""
    return {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
            "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim, "head_dim": cfg.qk_rope_head_dim, "rope_interleave": True,
            "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_topk,
            "moe_intermediate_size": cfg.moe_ffn_size, "n_shared_experts": cfg.moe_shared_experts,
            "first_k_dense_replace": cfg.moe_first_k_dense, "n_group": cfg.moe_n_group or 1,
            "topk_group": cfg.moe_topk_group or 1, "routed_scaling_factor": cfg.moe_routed_scaling_factor,
            "norm_topk_prob": cfg.moe_norm_topk_prob, "hidden_act": "silu", "attention_bias": False,
            "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_eps,
            "attention_dropout": cfg.attention_dropout, "num_nextn_predict_layers": cfg.mtp_num_layers, **hf_rope(cfg)}


def hub_mtp_layers(hf: dict, cfg: ModelConfig, names) -> int:
    """MTP modules to convert: config.json's ``num_nextn_predict_layers`` whose tensors the files hold."""
    wanted = hf.get("num_nextn_predict_layers") or 0
    return sum(1 for k in range(wanted) if f"model.layers.{cfg.num_layers + k}.eh_proj.weight" in names)


def is_deepseek_v3(cfg: ModelConfig) -> bool:
    """MLA with sigmoid-routed experts after dense layers, as HF's DeepseekV3 computes (else: an error)."""
    if not cfg.is_mla:
        return False
    dense_then_moe = all(cfg.is_moe_layer(i) == (i >= cfg.moe_first_k_dense) for i in range(cfg.num_layers))
    llama_shaped = (cfg.position_embedding, cfg.norm, cfg.activation) == ("rope", "rmsnorm", "swiglu")
    if cfg.bias or cfg.has_qkv_bias or cfg.qk_norm or not cfg.num_experts or cfg.moe_router != "sigmoid" \
            or not dense_then_moe or not llama_shaped:
        raise ValueError("model: MLA exports as HF's DeepSeek-V3 only, which needs rope, rmsnorm, swiglu, no biases "
                         "or QK-norm, and sigmoid-routed experts in every layer from moe_first_k_dense on. Fix: "
                         "export a model with those settings")
    return True


def _rope_order(rows: int, rope_dim: int, heads: int, to_native: bool) -> torch.Tensor:
    """Row order that turns each head's last ``rope_dim`` rows from interleaved pairs into halves (or back)."""
    head = rows // heads
    pairs = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    within = pairs if to_native else torch.argsort(pairs)
    one = torch.cat([torch.arange(head - rope_dim), head - rope_dim + within])
    return torch.cat([one + h * head for h in range(heads)])


def _attention_to_native(hf: dict, p: str, n: str, cfg) -> dict:
    a, ours = p + "self_attn.", n + "attention."
    qk_rows = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    kv_a = hf[a + "kv_a_proj_with_mqa.weight"]
    kv_a = kv_a[_rope_order(kv_a.shape[0], cfg.qk_rope_head_dim, 1, True)]
    q_order = _rope_order(qk_rows, cfg.qk_rope_head_dim, cfg.num_attention_heads, True)
    out = {ours + "kv_latent_norm.weight": hf[a + "kv_a_layernorm.weight"],
           ours + "kv_up.weight": hf[a + "kv_b_proj.weight"], ours + "proj.weight": hf[a + "o_proj.weight"]}
    if cfg.q_lora_rank:
        out.update({ours + "down.weight": torch.cat([hf[a + "q_a_proj.weight"], kv_a]),
                    ours + "q_latent_norm.weight": hf[a + "q_a_layernorm.weight"],
                    ours + "q_up.weight": hf[a + "q_b_proj.weight"][q_order]})
    else:
        out.update({ours + "down.weight": kv_a, ours + "q_proj.weight": hf[a + "q_proj.weight"][q_order]})
    return out


def _native_attention_to_hf(native: dict, p: str, n: str, cfg) -> dict:
    a, ours = p + "self_attn.", n + "attention."
    qk_rows = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    down = native[ours + "down.weight"]
    kv_a = down[cfg.q_lora_rank or 0:]
    q_order = _rope_order(qk_rows, cfg.qk_rope_head_dim, cfg.num_attention_heads, False)
    out = {a + "kv_a_proj_with_mqa.weight": kv_a[_rope_order(kv_a.shape[0], cfg.qk_rope_head_dim, 1, False)],
           a + "kv_a_layernorm.weight": native[ours + "kv_latent_norm.weight"],
           a + "kv_b_proj.weight": native[ours + "kv_up.weight"], a + "o_proj.weight": native[ours + "proj.weight"]}
    if cfg.q_lora_rank:
        out.update({a + "q_a_proj.weight": down[:cfg.q_lora_rank],
                    a + "q_a_layernorm.weight": native[ours + "q_latent_norm.weight"],
                    a + "q_b_proj.weight": native[ours + "q_up.weight"][q_order]})
    else:
        out[a + "q_proj.weight"] = native[ours + "q_proj.weight"][q_order]
    return out


def _norms(source: dict, p: str, n: str, to_native: bool) -> dict:
    pairs = {n + "input_norm.weight": p + "input_layernorm.weight",
             n + "post_attention_norm.weight": p + "post_attention_layernorm.weight"}
    return {ours: source[theirs] for ours, theirs in pairs.items()} if to_native else \
        {theirs: source[ours] for ours, theirs in pairs.items()}


def _feed_forward(source: dict, p: str, n: str, i: int, cfg, to_native: bool) -> dict:
    """Layer ``i``'s dense MLP, or its router, routed experts and shared experts, in either direction."""
    swiglu, experts = (swiglu_to_native, experts_to_native) if to_native else (swiglu_to_hf, experts_to_hf)

    def mlp(ours: str, theirs: str) -> dict:
        return swiglu(source, ours, theirs + "gate_proj", theirs + "up_proj", theirs + "down_proj", ("weight",))

    if not cfg.is_moe_layer(i):
        return mlp(n + "mlp.", p + "mlp.")
    out = experts(source, p, n, cfg, QWEN3_MOE_EXPERTS)
    if cfg.moe_shared_experts:
        out.update(mlp(n + "mlp.shared_experts.", p + "mlp.shared_experts."))
    return out


def deepseek_v3_layer_to_native(hf: dict, i: int, cfg) -> dict:
    return _block_to_native(hf, f"model.layers.{i}.", f"layers.{i}.", i, cfg)


def native_layer_to_deepseek_v3(native: dict, i: int, cfg) -> dict:
    return _block_to_hf(native, f"model.layers.{i}.", f"layers.{i}.", i, cfg)


def _block_to_native(hf: dict, p: str, n: str, i: int, cfg) -> dict:
    out = {**_norms(hf, p, n, True), **_attention_to_native(hf, p, n, cfg), **_feed_forward(hf, p, n, i, cfg, True)}
    if cfg.is_moe_layer(i) and cfg.moe_router_bias_update_rate > 0:
        out[n + "mlp.router.expert_bias"] = hf[p + "mlp.gate.e_score_correction_bias"]
    return out


def _block_to_hf(native: dict, p: str, n: str, i: int, cfg) -> dict:
    out = {**_norms(native, p, n, False), **_native_attention_to_hf(native, p, n, cfg),
           **_feed_forward(native, p, n, i, cfg, False)}
    if cfg.is_moe_layer(i):  # a model trained without the bias routes as with a zero one
        bias = n + "mlp.router.expert_bias"
        out[p + "mlp.gate.e_score_correction_bias"] = native[bias] if bias in native else torch.zeros(cfg.num_experts)
    return out


_MTP_PARTS = {"embedding_norm.weight": "enorm.weight", "hidden_norm.weight": "hnorm.weight",
              "projection.weight": "eh_proj.weight", "final_norm.weight": "shared_head.norm.weight"}


def deepseek_v3_mtp_to_native(hf: dict, k: int, cfg) -> dict:
    """MTP module ``k``: the hub's layer num_layers + k (its embedding and head copies are ours, shared)."""
    i = cfg.num_layers + k
    p, n = f"model.layers.{i}.", f"mtp.layers.{k}."
    return {**{n + ours: hf[p + theirs] for ours, theirs in _MTP_PARTS.items()},
            **_block_to_native(hf, p, n + "block.", i, cfg)}


def native_mtp_to_deepseek_v3(native: dict, k: int, cfg) -> dict:
    i = cfg.num_layers + k
    p, n = f"model.layers.{i}.", f"mtp.layers.{k}."
    head = "embedding.word_embeddings.weight" if cfg.tie_embeddings else "output_layer.weight"
    return {**{p + theirs: native[n + ours] for ours, theirs in _MTP_PARTS.items()},
            p + "embed_tokens.weight": native["embedding.word_embeddings.weight"],
            p + "shared_head.head.weight": native[head], **_block_to_hf(native, p, n + "block.", i, cfg)}
