"""Gradients a split backward holds from I to W, per token of one model chunk and micro-batch.

A zero-bubble schedule's I (``pipeline/split_backward.py``) records the gradient reaching each split node, a node
on the path to the stage input that also feeds a weight, and keeps it until W re-enters the graph there. Those
tensors are new (an unsplit backward frees each as soon as its node has run), so they add to the activations,
which a split backward keeps until W as well. Per token and TP rank (e = 2 or 4 bytes, t = tp, r = t under
sequence parallelism else 1; the names of ``activations.py``), counted for this code (one TP rank's stage of GPT
and of Llama blocks, fp32 and bf16, measured tensor by tensor, gives these sums exactly; TP/SP, MLA and MoE follow
the same rule from the shapes, not measured):

    each norm       4h/r: the gradient of its output, fp32 (norms compute in fp32; LayerNorm's node, or
                    RMSNorm's weight multiply)
    attention       e*(a+2g)*d/t (QKV's matmul output) + e*h (the output projection's: row-parallel, the whole
                    sequence before the reduce-scatter); MLA: e*(q_lora + kv_lora + qk_rope) (the replicated
                    down-projection), e*a*d/t (queries), e*a*(qk_nope + v)/t (keys and values), e*h, and the
                    latent norms' 4*(q_lora + kv_lora)
    MLP             e*f/t (fc1; SwiGLU 2e*f/t) + e*h (fc2); MoE: per routed row e*(f/t + h) (SwiGLU 2f), the
                    router's fp32 logits 4E/r and the shared experts as an MLP
    bias adds       the row-parallel output's bias, added by the caller, shares the projection's gradient; under
                    sequence parallelism it is added to the rank's slice: e*h/r more, twice a layer

The last stage adds its norm and the head's logits gradient e*V/t (padded vocabulary), and each MTP module its
block, the norm of the hidden state it reads (the embedding's norm is off the input path), its projection's
output (e*h) and its head again. The first stage holds nothing: without an input its whole backward runs as W
(it keeps only the received gradient, e*h/r, ignored here). Not subtracted: under Domino, I computes one linear's
weight gradient early (the last input-gradient wait's) and releases what it recorded. Full recompute is assumed
to record the same (not measured).
"""
from __future__ import annotations

from ..config.schema import Config
from .activations import sequence_shard, weight_bytes
from .moe import whole_experts


def _mlp(e: int, h: int, width: float, parts: int) -> float:
    return e * (parts * width + h)


def layer_held_bytes(cfg: Config, moe: bool = False) -> float:
    """Bytes per token that I records in one block and W frees (module docstring); ``moe``: a block with experts."""
    model, par = cfg.model, cfg.parallel
    e, t = weight_bytes(cfg), par.tp
    r = sequence_shard(cfg)
    h, a, parts = model.hidden_size, model.num_attention_heads, 2 if model.activation == "swiglu" else 1
    norms = 2 * 4 * h / r
    biases = 2 * e * h / r if model.bias and r > 1 else 0.0
    if model.is_mla:
        q_rank, kv_rank = model.q_lora_rank or 0, model.kv_lora_rank
        attention = e * (q_rank + kv_rank + model.qk_rope_head_dim + a * model.key_head_dim / t
                         + a * (model.qk_nope_head_dim + model.v_head_dim) / t + h) + 4 * (q_rank + kv_rank)
    else:
        attention = e * ((a + 2 * model.kv_heads) * model.key_head_dim / t + h)
    if not moe:
        return norms + biases + attention + _mlp(e, h, model.ffn_size / t, parts)
    rows, width = (model.moe_topk / t, model.moe_ffn_size) if whole_experts(par) else (
        model.moe_topk, model.moe_ffn_size / t)
    shared = _mlp(e, h, model.moe_shared_experts * model.moe_ffn_size / t, parts) if model.moe_shared_experts else 0
    return norms + biases + attention + rows * _mlp(e, h, width, parts) + 4 * model.num_experts / r + shared


def chunk_held_bytes(cfg: Config, layers: int, first: bool, last: bool, moe_layers: int = 0) -> float:
    """Bytes per token that I records in one model chunk of ``layers`` blocks (``moe_layers`` with experts) and
    holds until W; nothing on the first stage."""
    if first:
        return 0.0
    model, par = cfg.model, cfg.parallel
    e, t = weight_bytes(cfg), par.tp
    r = sequence_shard(cfg)
    total = (layers - moe_layers) * layer_held_bytes(cfg) + moe_layers * (
        layer_held_bytes(cfg, moe=True) if moe_layers else 0.0)
    if last:
        head = 4 * model.hidden_size / r + e * model.padded_vocab_size(t) / t
        block = layer_held_bytes(cfg, moe=model.is_moe_layer(model.num_layers)) if model.mtp_num_layers else 0.0
        total += head + model.mtp_num_layers * (block + 4 * model.hidden_size / r + e * model.hidden_size + head)
    return total
