"""HF config.json <-> ``ModelConfig`` for GPT-2, Llama 1/2/3, Mixtral, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3,
and the run config a conversion ships with.

Only settings that change the function a model computes are carried; anything HF can express but
this transformer cannot (another RoPE type, biases on only some linears, GPT-2's per-layer attention
scaling, a sliding window shorter than the sequence) is refused with the key and value named, instead of
converting into a silently different model. Mixtral's training-only settings: router_aux_loss_coef becomes
moe_aux_loss_coeff as it is (the same number weighs differently: HF's balance loss is top_k times ours and
averaged over layers, ours is summed over them); router_jitter_noise is not carried; a native capacity factor is
not exported (HF's Mixtral is dropless).
"""
from __future__ import annotations

import json
import os
from dataclasses import replace

from ..config import Config, ModelConfig
from ..config.schema import OptimizerConfig, ParallelConfig, TokenizerConfig, TrainConfig
from .deepseek_v3 import deepseek_v3_hf_config, deepseek_v3_model, is_deepseek_v3
from .hf_rope import _unsupported, hf_rope, rope_settings

MODEL_TYPES = ("gpt2", "llama", "mixtral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}
GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
TORCH_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found. Fix: --input must be a local HF model directory holding "
                                f"config.json and the safetensors weights (nothing is downloaded)")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def detect_model_type(hf: dict, requested: str | None = None) -> str:
    """config.json's model_type, checked against --model when that is given."""
    found = hf.get("model_type")
    if found not in MODEL_TYPES:
        raise _unsupported("model_type", found, f"is not a supported model type ({', '.join(MODEL_TYPES)})",
                           "convert a GPT-2, Llama 1/2/3, Mixtral, Qwen2, Qwen3, Qwen3-MoE or DeepSeek-V3 checkpoint "
                           f"({' / '.join(ARCHITECTURES.values())})")
    if requested is not None and requested != found:
        raise _unsupported("model_type", found, f"differs from --model {requested}", f"pass --model {found}")
    return found


def _gpt2_model(hf: dict) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise _unsupported("activation_function", act, f"is not one of {', '.join(GPT2_ACTIVATIONS)}",
                           "convert a model with GPT-2's gelu_new activation")
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        raise _unsupported("scale_attn_by_inverse_layer_idx / scale_attn_weights",
                           (hf.get("scale_attn_by_inverse_layer_idx"), hf.get("scale_attn_weights")),
                           "only GPT-2's standard 1/sqrt(head_dim) attention scaling is supported",
                           "convert a model with the standard GPT-2 attention")
    hidden = hf["n_embd"]
    positions = hf.get("n_positions", hf.get("n_ctx", 1024))
    return ModelConfig(num_layers=hf["n_layer"], hidden_size=hidden, ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
                       num_attention_heads=hf["n_head"], seq_length=positions, max_position_embeddings=positions,
                       vocab_size=hf["vocab_size"], position_embedding="learned", norm="layernorm",
                       norm_eps=hf.get("layer_norm_epsilon", 1e-5), activation=GPT2_ACTIVATIONS[act], bias=True,
                       tie_embeddings=hf.get("tie_word_embeddings", True),
                       attention_dropout=hf.get("attn_pdrop", 0.1), hidden_dropout=hf.get("resid_pdrop", 0.1),
                       init_std=hf.get("initializer_range", 0.02), make_vocab_size_divisible_by=128)


def _llama_model(hf: dict) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", hf["hidden_act"], "must be silu (Llama's SwiGLU)",
                           "convert a standard Llama checkpoint")
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise _unsupported("attention_bias / mlp_bias", (attention_bias, mlp_bias),
                           "model.bias switches the attention and MLP biases together",
                           "convert a model with both true or both false")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    rope = rope_settings(hf)
    positions = hf.get("max_position_embeddings", 2048)
    # with Llama-3.1 scaling the listed context is the stretched one; pre-training length is the original
    seq_length = rope["rope_original_max_position"] if "rope_scaling_factor" in rope else positions
    return ModelConfig(num_layers=hf["num_hidden_layers"], hidden_size=hidden, ffn_hidden_size=hf["intermediate_size"],
                       num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
                       kv_channels=head_dim if head_dim * heads != hidden else None, seq_length=min(seq_length,
                       positions), max_position_embeddings=positions, vocab_size=hf["vocab_size"],
                       position_embedding="rope", norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
                       activation="swiglu", bias=attention_bias, tie_embeddings=hf.get("tie_word_embeddings", False),
                       attention_dropout=hf.get("attention_dropout", 0.0), hidden_dropout=0.0,
                       init_std=hf.get("initializer_range", 0.02), make_vocab_size_divisible_by=128, **rope)


def _mixtral_model(hf: dict) -> ModelConfig:
    """Llama's attention and norms; every MLP is num_local_experts SwiGLU experts under Mixtral's router
    (softmax over all experts, top-k, renormalised: ``moe_router`` softmax, exactly), dropless."""
    return replace(_llama_model(hf), num_experts=hf["num_local_experts"], moe_topk=hf["num_experts_per_tok"],
                   moe_ffn_hidden_size=hf["intermediate_size"], moe_router="softmax",
                   moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)), moe_z_loss_coeff=0.0,
                   moe_capacity_factor=None, moe_shared_experts=0, moe_layer_freq=1)


def _qwen2_model(hf: dict) -> ModelConfig:
    """Llama's shapes with biases on the query, key and value projections alone."""
    return replace(_llama_model({**hf, "attention_bias": False}), qkv_bias=True)


def _qwen3_model(hf: dict) -> ModelConfig:
    """Llama's shapes with an RMSNorm over each head's query and key (``attention_bias`` covers q, k, v and o)."""
    if hf.get("attention_bias"):
        raise _unsupported("attention_bias", True, "Qwen3 puts it on q, k, v and o but never on the MLP, which "
                           "model.bias cannot express", "convert a Qwen3 model without attention biases")
    return replace(_llama_model(hf), qk_norm=True)


def _qwen3_moe_model(hf: dict) -> ModelConfig:
    """Qwen3's attention; experts of moe_intermediate_size under a softmax top-k router (renormalised when
    norm_topk_prob), except the mlp_only_layers and where (layer + 1) % decoder_sparse_step != 0."""
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    layers = [int(i not in dense and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"])]
    experts = hf.get("num_experts", hf.get("num_local_experts"))  # the hub's spelling, transformers 5's
    return replace(_qwen3_model(hf), num_experts=experts if experts else hf["num_experts"],
                   moe_topk=hf["num_experts_per_tok"],
                   moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_router="softmax",
                   moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                   moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)), moe_z_loss_coeff=0.0,
                   moe_capacity_factor=None, moe_shared_experts=0, moe_layer_freq=1 if all(layers) else layers)


_MODELS = {"gpt2": _gpt2_model, "llama": _llama_model, "mixtral": _mixtral_model, "qwen2": _qwen2_model,
           "qwen3": _qwen3_model, "qwen3_moe": _qwen3_moe_model, "deepseek_v3": deepseek_v3_model}


def _check_sliding_window(hf: dict, seq_length: int) -> None:
    """HF attends to the last sliding_window tokens (the query's own included); this model to the whole
    sequence, so the two agree only when the window holds it."""
    window = hf.get("sliding_window")
    if window is not None and window < seq_length:
        raise _unsupported("sliding_window", window, f"is shorter than the sequence length {seq_length} (this model "
                           "has no sliding-window attention)", f"convert with --seq-length {window} or less")


def model_config_from_hf(hf: dict, model_type: str | None = None, seq_length: int | None = None) -> ModelConfig:
    """``ModelConfig`` of a GPT-2, Llama or Mixtral config.json (either transformers 4.x or 5.x spelling), at
    ``seq_length`` when given (else the model's own)."""
    model_type = detect_model_type(hf, model_type)
    try:
        cfg = _MODELS[model_type](hf)
    except KeyError as missing:
        raise _unsupported(str(missing.args[0]), None, f"is required for a {model_type} model but missing",
                           "use the config.json the weights were saved with") from None
    cfg = cfg if seq_length is None else replace(cfg, seq_length=seq_length)
    if hf.get("use_sliding_window", True):  # Qwen lists a window that it does not use unless asked to
        _check_sliding_window(hf, cfg.seq_length)
    return cfg


def _qwen_type_of(cfg: ModelConfig) -> str | None:
    """Qwen3 (QK-norm; -MoE with experts) or Qwen2 (q/k/v biases alone) for a Llama-shaped model, else None."""
    if cfg.qk_norm:
        experts_differ = cfg.num_experts and (cfg.moe_router != "softmax" or cfg.moe_shared_experts)
        if cfg.bias or cfg.has_qkv_bias or experts_differ:
            raise ValueError(f"model: Qwen3 in HF needs bias=false, no q/k/v biases, and for experts "
                             f"moe_router=softmax without shared experts; this model has bias={cfg.bias}, "
                             f"qkv_bias={cfg.qkv_bias}, moe_router={cfg.moe_router}, "
                             f"moe_shared_experts={cfg.moe_shared_experts}. Fix: export a model with those settings")
        return "qwen3_moe" if cfg.num_experts else "qwen3"
    if cfg.has_qkv_bias and not cfg.bias:
        if cfg.num_experts:
            raise ValueError("model: q/k/v biases with experts has no HF export (Qwen2-MoE is not supported). Fix: "
                             "export a dense model, or one without qkv_bias")
        return "qwen2"
    return None


def model_type_of(cfg: ModelConfig) -> str:
    """Which HF architecture a native model is: GPT-2 (learned, layernorm, gelu) or Llama (rope, rmsnorm, swiglu),
    Mixtral when that Llama has experts, Qwen2 / Qwen3 / Qwen3-MoE by their attention (``_qwen_type_of``)."""
    switches = (cfg.position_embedding, cfg.norm, cfg.activation)
    if is_deepseek_v3(cfg):
        return "deepseek_v3"
    if cfg.mtp_num_layers:
        raise ValueError("model: multi-token prediction modules exist in HF's DeepSeek-V3 files only. Fix: export a "
                         "DeepSeek-V3-shaped model (multi_latent_attention, moe_router=sigmoid), or train without")
    if cfg.num_experts and (cfg.moe_router_bias_update_rate > 0 or cfg.moe_n_group or cfg.moe_routed_scaling_factor
                            != 1.0):
        raise ValueError("model: an expert bias, group-limited routing or a routed scaling factor exists in HF's "
                         "DeepSeek-V3 only (Mixtral and Qwen3-MoE would route differently without them). Fix: export "
                         "a DeepSeek-V3-shaped model (multi_latent_attention, moe_router=sigmoid), or train without")
    if switches == ("rope", "rmsnorm", "swiglu") and _qwen_type_of(cfg):
        return _qwen_type_of(cfg)
    if switches in (("learned", "layernorm", "gelu_tanh"), ("learned", "layernorm", "gelu")):
        if not cfg.bias or cfg.num_experts or cfg.query_groups != cfg.num_attention_heads or cfg.kv_channels not in (
                None, cfg.hidden_size // cfg.num_attention_heads):
            raise ValueError("model: GPT-2 in HF needs bias=true, no experts, no grouped-query attention and "
                             "kv_channels = hidden_size / heads. Fix: export a model with those settings")
        return "gpt2"
    if switches == ("rope", "rmsnorm", "swiglu") and cfg.num_experts:
        every_layer = all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        if cfg.bias or cfg.moe_router != "softmax" or cfg.moe_shared_experts or not every_layer \
                or not cfg.moe_norm_topk_prob:
            raise ValueError(f"model: Mixtral in HF needs bias=false, moe_router=softmax, no shared experts and "
                             f"experts in every layer; this model has bias={cfg.bias}, moe_router={cfg.moe_router}, "
                             f"moe_shared_experts={cfg.moe_shared_experts}, moe_layer_freq={cfg.moe_layer_freq}. "
                             "Fix: export a model with those settings")
        return "mixtral"
    if switches == ("rope", "rmsnorm", "swiglu"):
        return "llama"
    raise ValueError(f"model.(position_embedding, norm, activation) = {switches}: matches neither GPT-2 "
                     "(learned, layernorm, gelu_tanh) nor Llama (rope, rmsnorm, swiglu). Fix: only those two "
                     "architectures have an HF export")


def hf_config_from_model(cfg: ModelConfig, dtype_name: str) -> dict:
    """config.json for a native model; Llama's and Mixtral's RoPE is written in both the 4.x and the 5.x spelling."""
    model_type = model_type_of(cfg)
    common = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "vocab_size": cfg.vocab_size,
              "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
              "dtype": dtype_name, "torch_dtype": dtype_name}
    if model_type == "gpt2":
        act = "gelu_new" if cfg.activation == "gelu_tanh" else "gelu"
        return {**common, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_attention_heads,
                "n_inner": cfg.ffn_size, "n_positions": cfg.max_positions, "activation_function": act,
                "layer_norm_epsilon": cfg.norm_eps, "attn_pdrop": cfg.attention_dropout,
                "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout}
    if model_type == "deepseek_v3":
        return {**common, **deepseek_v3_hf_config(cfg)}
    mlp = _hf_feed_forward(cfg, model_type)
    return {**common, **mlp, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.query_groups,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.max_positions,
            "rms_norm_eps": cfg.norm_eps, "attention_dropout": cfg.attention_dropout,
            **hf_rope(cfg)}


def _hf_feed_forward(cfg: ModelConfig, model_type: str) -> dict:
    """config.json's MLP / expert keys (and what else differs between the Llama-shaped families)."""
    if model_type == "llama":
        return {"intermediate_size": cfg.ffn_size, "attention_bias": cfg.bias, "mlp_bias": cfg.bias}
    if model_type == "mixtral":
        return {"intermediate_size": cfg.moe_ffn_size, "num_local_experts": cfg.num_experts,
                "num_experts_per_tok": cfg.moe_topk, "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
                "router_jitter_noise": 0.0, "output_router_logits": False, "sliding_window": None}
    qwen = {"intermediate_size": cfg.ffn_size, "use_sliding_window": False, "sliding_window": None}
    if model_type == "qwen2":
        return qwen
    qwen["attention_bias"] = False
    if model_type == "qwen3_moe":
        qwen.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_topk,
                    moe_intermediate_size=cfg.moe_ffn_size, norm_topk_prob=cfg.moe_norm_topk_prob,
                    decoder_sparse_step=1, router_aux_loss_coef=cfg.moe_aux_loss_coeff, output_router_logits=False,
                    mlp_only_layers=[i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)])
    return qwen


def run_config(model: ModelConfig, *, hf_dir: str, output: str, tp: int, pp: int, dtype_name: str,
               ep: int = 1) -> Config:
    """The config.yaml written beside a converted checkpoint: ready to fine-tune or evaluate once data.path is set."""
    output = os.path.abspath(output)
    has_tokenizer = any(os.path.exists(os.path.join(hf_dir, name)) for name in TOKENIZER_FILES)
    tokenizer = (TokenizerConfig(type="HuggingFaceTokenizer", model=os.path.abspath(hf_dir)) if has_tokenizer
                 else TokenizerConfig())
    cfg = Config(model=model, parallel=ParallelConfig(tp=tp, pp=pp, ep=ep),
                 train=TrainConfig(steps=1000, micro_batch_size=1, global_batch_size=8, bf16=dtype_name == "bfloat16"),
                 optimizer=OptimizerConfig(lr=1e-5, min_lr=1e-6, weight_decay=0.1, warmup_steps=50,
                                           lr_schedule="cosine"),
                 tokenizer=tokenizer)
    cfg.checkpoint.load = output
    cfg.checkpoint.dir = os.path.join(output, "finetune")
    cfg.log.dir = os.path.join(output, "finetune", "logs")
    return cfg
