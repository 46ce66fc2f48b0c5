"""Parameter and FLOP counts from the model config alone, without building the model.

Used for MFU, for the planner, and to check presets against published model sizes. Notation:
h hidden, L layers, a heads, g KV groups, d head dim, f FFN width, V vocab, P position-table rows, s sequence.

Parameters, summed over the whole model (not one TP shard):
- token embedding V*h; learned positions P*h (none with rope); untied output head V*h (no bias);
- per layer: attention q a*d*h, k and v g*d*h each, output a*d*h, with biases a*d + 2*g*d + h;
  MLP 2*h*f (gelu) or 3*h*f (swiglu: gate, up, down), with biases f + h (gelu) or 2*f + h (swiglu);
  two norms; plus one final norm. A LayerNorm has weight and bias (2*h, whatever ``bias`` says, as in
  Megatron and GPT-2), an RMSNorm weight only (h).

Training FLOPs per token (forward + backward, no recompute):
- every weight matmul costs 2 FLOPs per weight per token forward, so 2*N_mm with N_mm the matmul weights
  (attention and MLP projections and the output head, which is a matmul even when tied; embeddings,
  norms and biases are excluded);
- attention scores Q.K^T and the weighted sum over V each cost 2*s*a*d per token per layer forward,
  counted over the full s x s square (as Megatron and PaLM count MFU; the causal mask's skipped half
  is not subtracted);
- backward costs twice the forward (gradients for inputs and for weights), so training = 3 x forward:
      flops_per_token = 6*N_mm + 12*L*s*a*d.
For GPT (f = 4h, g = a, a*d = h) this equals Megatron's 72*L*h^2 + 12*L*s*h + 6*V*h.
"""
from __future__ import annotations

from megatron_domino.config.schema import ModelConfig


def _vocab(model: ModelConfig, tp: int, padded: bool) -> int:
    return model.padded_vocab_size(tp) if padded else model.vocab_size


def _layer_matmul_parameters(model: ModelConfig) -> int:
    """Weights of one block's projections (no biases, no norms)."""
    h, f, d = model.hidden_size, model.ffn_size, model.head_dim
    q_width, kv_width = model.num_attention_heads * d, model.query_groups * d
    attention = h * q_width + 2 * h * kv_width + q_width * h
    mlp = (3 if model.activation == "swiglu" else 2) * h * f
    return attention + mlp


def norm_parameters(model: ModelConfig) -> int:
    """One norm's parameters: LayerNorm has weight and bias, RMSNorm a weight only."""
    return (1 if model.norm == "rmsnorm" else 2) * model.hidden_size


def count_parameters(model: ModelConfig, tp: int = 1, padded_vocab: bool = False) -> int:
    """Total parameters of the model. ``padded_vocab`` counts the TP-padded vocabulary (``tp`` sets the padding)."""
    h, f, d = model.hidden_size, model.ffn_size, model.head_dim
    vocab = _vocab(model, tp, padded_vocab)
    per_layer = _layer_matmul_parameters(model) + 2 * norm_parameters(model)
    if model.bias:
        q_width, kv_width = model.num_attention_heads * d, model.query_groups * d
        per_layer += q_width + 2 * kv_width + h
        per_layer += (2 * f if model.activation == "swiglu" else f) + h
    total = vocab * h + model.num_layers * per_layer + norm_parameters(model)
    if model.position_embedding == "learned":
        total += model.max_positions * h
    if not model.tie_embeddings:
        total += vocab * h
    return total


def flops_per_token(model: ModelConfig, seq_length: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token at ``seq_length`` (default: the model's), unpadded vocab."""
    s = model.seq_length if seq_length is None else seq_length
    matmul_weights = model.num_layers * _layer_matmul_parameters(model) + model.vocab_size * model.hidden_size
    attention = 12 * model.num_layers * s * model.num_attention_heads * model.head_dim
    return float(6 * matmul_weights + attention)
