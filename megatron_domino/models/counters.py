"""Parameter and FLOP counts from the model config alone, without building the model.

Used for MFU, for the planner, and to check presets against published model sizes. Notation:
h hidden, L layers, a heads, g KV groups, d head dim, f FFN width, V vocab, P position-table rows, s sequence.

Parameters, summed over the whole model (not one TP shard):
- token embedding V*h; learned positions P*h (none with rope); untied output head V*h (no bias);
- per layer: attention q a*d*h, k and v g*d*h each, output a*d*h, with biases a*d + 2*g*d (``qkv_bias``) + h;
  Qwen3's QK-norm adds 2*d; MLA (``models.mla``) has its down-projection h*(q_lora_rank + kv_lora_rank +
  qk_rope_head_dim), queries' up-projection (or q_proj), keys' and values' up-projection, output a*v_head_dim*h,
  and the latents' two norms;
  MLP 2*h*f (gelu) or 3*h*f (swiglu: gate, up, down), with biases f + h (gelu) or 2*f + h (swiglu);
  two norms; plus one final norm. A LayerNorm has weight and bias (2*h, whatever ``bias`` says, as in
  Megatron and GPT-2), an RMSNorm weight only (h).

Training FLOPs per token (forward + backward, no recompute):
- every weight matmul costs 2 FLOPs per weight per token forward, so 2*N_mm with N_mm the matmul weights
  (attention and MLP projections and the output head, which is a matmul even when tied; embeddings,
  norms and biases are excluded);
- attention scores Q.K^T and the weighted sum over V each cost 2*s*a*d per token per layer forward (MLA: d is
  the key head size for the scores, v_head_dim for the sum),
  counted over the full s x s square (as Megatron and PaLM count MFU; the causal mask's skipped half
  is not subtracted);
- backward costs twice the forward (gradients for inputs and for weights), so training = 3 x forward:
      flops_per_token = 6*N_mm + 12*L*s*a*d.
For GPT (f = 4h, g = a, a*d = h) this equals Megatron's 72*L*h^2 + 12*L*s*h + 6*V*h.

Mixture of experts (``model.num_experts``): an MoE layer's MLP is replaced by a router E*h (no bias), E
experts and the shared experts, each an MLP of its width. *Total* parameters count every expert; *active*
ones (``active=True``) only the top-k experts a token runs through (router and shared experts included).
FLOPs per token, and so MFU, count the active matmul weights only.

Multi-token prediction (``model.mtp_num_layers`` = D, ``models/mtp.py``): each module adds a block of the last
layer's kind, three norms and its projection 2*h*h (it shares the embedding and the output head); its FLOPs are the
block's, the projection's and one more pass of the output head: 6*(block + 2*h*h + V*h) + the block's attention.
"""
from __future__ import annotations

from megatron_domino.config.schema import ModelConfig


def _vocab(model: ModelConfig, tp: int, padded: bool) -> int:
    return model.padded_vocab_size(tp) if padded else model.vocab_size


def _attention_weights(model: ModelConfig) -> int:
    """Weights of one block's attention projections (no biases)."""
    if model.is_mla:
        return _latent_attention_weights(model)
    q_width, kv_width = model.num_attention_heads * model.head_dim, model.query_groups * model.head_dim
    return model.hidden_size * q_width + 2 * model.hidden_size * kv_width + q_width * model.hidden_size


def _latent_attention_weights(model: ModelConfig) -> int:
    """MLA: the down-projection to the latents, the up-projections (or q_proj), the output projection."""
    h, a = model.hidden_size, model.num_attention_heads
    qk, q_rank = model.qk_nope_head_dim + model.qk_rope_head_dim, model.q_lora_rank
    down = h * ((q_rank or 0) + model.kv_lora_rank + model.qk_rope_head_dim)
    queries = q_rank * a * qk if q_rank else h * a * qk
    keys_values = model.kv_lora_rank * a * (model.qk_nope_head_dim + model.v_head_dim)
    return down + queries + keys_values + a * model.v_head_dim * h


def _mlp(model: ModelConfig, ffn: int, biases: bool) -> int:
    """One MLP of width ``ffn``: 2*h*f (gelu) or 3*h*f (swiglu) weights, and biases when the model has them."""
    weights = (3 if model.activation == "swiglu" else 2) * model.hidden_size * ffn
    if not (biases and model.bias):
        return weights
    return weights + (2 * ffn if model.activation == "swiglu" else ffn) + model.hidden_size


def _feed_forward(model: ModelConfig, layer: int, active: bool, biases: bool) -> int:
    """Layer ``layer``'s feed-forward parameters: the MLP, or router, experts (top-k if ``active``) and shared ones."""
    if not model.is_moe_layer(layer):
        return _mlp(model, model.ffn_size, biases)
    experts = model.moe_topk if active else model.num_experts
    shared = _mlp(model, model.moe_shared_experts * model.moe_ffn_size, biases) if model.moe_shared_experts else 0
    return model.num_experts * model.hidden_size + experts * _mlp(model, model.moe_ffn_size, biases) + shared


def norm_parameters(model: ModelConfig) -> int:
    """One norm's parameters: LayerNorm has weight and bias, RMSNorm a weight only."""
    return (1 if model.norm == "rmsnorm" else 2) * model.hidden_size


def mtp_module_parameters(model: ModelConfig) -> int:
    """One MTP module's own parameters beside its block: three norms and the [embedding; hidden] projection."""
    return 3 * norm_parameters(model) + 2 * model.hidden_size ** 2


def count_parameters(model: ModelConfig, tp: int = 1, padded_vocab: bool = False, active: bool = False) -> int:
    """Total parameters of the model (``active``: those one token runs through, for MoE), MTP's modules included.
    ``padded_vocab`` counts the TP-padded vocabulary (``tp`` sets the padding)."""
    h = model.hidden_size
    vocab = _vocab(model, tp, padded_vocab)
    blocks = range(model.num_layers + model.mtp_num_layers)
    total = vocab * h + norm_parameters(model) + sum(_block_parameters(model, i, active) for i in blocks)
    total += model.mtp_num_layers * mtp_module_parameters(model)
    if model.position_embedding == "learned":
        total += model.max_positions * h
    if not model.tie_embeddings:
        total += vocab * h
    return total


def _block_parameters(model: ModelConfig, layer: int, active: bool) -> int:
    h, d = model.hidden_size, model.head_dim
    per_layer = _attention_weights(model) + 2 * norm_parameters(model)
    if model.is_mla:  # the latents' norms
        per_layer += (model.q_lora_rank or 0) + model.kv_lora_rank
    elif model.has_qkv_bias:
        per_layer += (model.num_attention_heads + 2 * model.query_groups) * d
    if model.bias:
        per_layer += h
    if model.qk_norm:
        per_layer += 2 * d
    return per_layer + _feed_forward(model, layer, active, biases=True)


def flops_per_token(model: ModelConfig, seq_length: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token at ``seq_length`` (default: the model's), unpadded vocab;
    active weights only (MoE)."""
    s = model.seq_length if seq_length is None else seq_length
    h, depth = model.hidden_size, model.mtp_num_layers
    blocks = model.num_layers + depth
    matmul_weights = (1 + depth) * model.vocab_size * h + depth * 2 * h * h + sum(
        _attention_weights(model) + _feed_forward(model, i, active=True, biases=False) for i in range(blocks))
    score_dim, value_dim = (model.key_head_dim, model.v_head_dim) if model.is_mla else (model.head_dim,) * 2
    attention = 6 * blocks * s * model.num_attention_heads * (score_dim + value_dim)
    return float(6 * matmul_weights + attention)
