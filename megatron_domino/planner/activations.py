"""Activations: the bytes autograd saves for backward, per micro-batch, counted tensor by tensor for
OUR block rather than with Korthikanti et al.'s formula (34*s*b*h + 5*a*s^2*b bytes per layer for
Megatron's fused fp16 kernels), which does not describe this code: norms here compute in fp32 (their
saved input is a 4-byte copy, and CPU builds of torch decompose RMSNorm and save its normalised output
too; CUDA builds run the fused ``_fused_rms_norm``, which saves input and rstd only), SDPA is a flash
kernel on CUDA and on CPU so the a*s^2 score matrix is never stored (only a fp32 logsumexp; the ``math``
backend would store it: not modelled), GQA's K/V reach SDPA unexpanded (except under the ``efficient``
kernel, which copies them per query head), RoPE's rotated Q/K are new tensors, and the sequence-parallel
all-gather's output (the full sequence) is what the following linear saves. Per token and TP rank (e = 2 or 4 bytes,
t = tp, r = t under sequence parallelism else 1, a*d = query width, g*d = KV width, f = FFN):

    each norm       LayerNorm 4h/r + 8/r (fp32 input, mean, rstd); RMSNorm 4h/r + 4/r on CUDA (fp32
                    input, rstd), 8h/r + 4/r on CPU (also the fp32 normalised output)
    attention       e*h (QKV input)  + e*(a+2g)*d/t (the QKV output, while a view of it is saved) + the
                    new tensors: Q e*a*d/t and K e*g*d/t under RoPE, K and V e*a*d/t each when expanded
                    + e*a*d/t (SDPA output = projection input) + 4a/t (logsumexp)
    MLP             e*h (FC1 input) + GeLU 2e*f/t (FC1 output, activation output) or SwiGLU 4e*f/t
    MoE             in place of the MLP: the router and k routed rows per token (``moe.py``), and the
                    shared experts as an MLP of width moe_shared_experts * f
    dropout         a mask of h/r elements after attention and after the MLP: 1 byte each on CUDA
                    (a bool mask), e bytes on CPU (torch keeps a scaled mask of the input's dtype);
                    attention-probability dropout keeps no mask in flash attention (on CPU, SDPA with
                    dropout falls back to the math kernel and keeps the score matrix: not modelled)

Multi-head latent attention (``models/mla.py``) is counted with the attention row above, as g = a heads of
the key head size d (qk_nope + qk_rope; its values are padded to d for the kernels): an approximation, not
its tensors one by one. Its projection input, which full recompute keeps, is the values' width: e*a*v/t
(v = v_head_dim, cut from the padded SDPA output).

Selective recompute drops the logsumexp (SDPA's other inputs are the checkpoint's inputs and its output
is the projection's input, so nothing else). Full recompute keeps, per layer, each phase's input
(2e*h/r), the two projection inputs (e*a*d/t, MLA e*a*v/t; + e*f/t) and the dropout masks; one phase's
activations are rebuilt at a time in backward (counted as transient). Per model chunk and micro-batch, the
first stage adds token ids (8 B/token) and an embedding dropout mask; RoPE adds fp32 cos/sin (8 B per token
and rotated dimension: d, MLA's qk_rope); the last stage adds a norm, the head input (e*h) and the loss's
fp32 softmax (4V/t) with int64 targets; other stages keep the received input (e*h/r) when it is not the
first norm's own saved input.
Multi-token prediction adds, per module, on the last stage: a block of the last layer's kind, its token ids,
two norms, the [embedding; hidden] concatenation the projection reads (2e*h/r) and the head's terms again.

Context parallelism (cp > 1) and documents. A rank holds s/cp tokens of each sequence, so every
per-token term above counts s/cp tokens. Ring attention (``models/ring_attention.py``) runs the same
flash-style kernels block by block and saves what they save for the local tokens (the K/V blocks received
from other ranks are sent on, not kept); the all-to-alls (``models/ulysses.py``) save about the same,
head-sharded. Their backward peaks are transient, beside full recompute's rebuilt phase (``context_parallel.py``).
Document masking (``data.reset_attention_mask``) runs one causal kernel call per document on slices of
the same Q, K and V: its cost is the O(L) offsets, so there is no L^2 term with or without CP.
"""
from __future__ import annotations

from dataclasses import replace

from ..config.schema import Config, ModelConfig
from .hardware import GPU
from .moe import routed_activation_bytes


def weight_bytes(cfg: Config) -> int:
    return 2 if (cfg.train.bf16 or cfg.train.fp16) else 4


def sequence_shard(cfg: Config) -> int:
    """r: how many ranks share a token's hidden state outside attention and the MLP (tp under sequence
    parallelism, else 1)."""
    return cfg.parallel.tp if cfg.parallel.sequence_parallel and cfg.parallel.tp > 1 else 1


def _norm_bytes(model: ModelConfig, shard: int, gpu: GPU) -> float:
    h = model.hidden_size
    if model.norm == "layernorm":
        return (4 * h + 8) / shard
    return ((4 if gpu.is_cuda else 8) * h + 4) / shard


def _dropout_mask_bytes(cfg: Config, gpu: GPU) -> float:
    """Bytes per token of one hidden-state dropout mask (0 without dropout)."""
    if cfg.model.hidden_dropout == 0:
        return 0.0
    return (1 if gpu.is_cuda else weight_bytes(cfg)) * cfg.model.hidden_size / sequence_shard(cfg)


def _mlp_bytes(cfg: Config, width: int) -> float:
    """Saved bytes per token of a dense MLP of ``width`` without its norm and mask (full recompute: fc2's input)."""
    e, t = weight_bytes(cfg), cfg.parallel.tp
    if cfg.model.recompute == "full":
        return e * width / t
    return e * cfg.model.hidden_size + (4 if cfg.model.activation == "swiglu" else 2) * e * width / t


def _feed_forward_bytes(cfg: Config, moe: bool) -> float:
    """The dense MLP's, or an MoE layer's: routed experts (``moe.py``) and the shared ones as a dense MLP."""
    model = cfg.model
    if not moe:
        return _mlp_bytes(cfg, model.ffn_size)
    shared = _mlp_bytes(cfg, model.moe_shared_experts * model.moe_ffn_size) if model.moe_shared_experts else 0.0
    return routed_activation_bytes(cfg, weight_bytes(cfg)) + shared


def layer_activation_bytes(cfg: Config, gpu: GPU, moe: bool = False) -> tuple[float, float, float]:
    """(saved bytes per token of one block, of its attention phase, of its MLP phase) on one TP rank; ``moe``:
    a block with experts."""
    model, par = cfg.model, cfg.parallel
    e, t = weight_bytes(cfg), par.tp
    r = sequence_shard(cfg)
    h, d = model.hidden_size, model.key_head_dim
    a, g = model.num_attention_heads, model.kv_heads
    rope = model.position_embedding == "rope"
    expanded = g < a and model.attention_backend == "efficient"  # K and V copied per query head
    mask = _dropout_mask_bytes(cfg, gpu)
    if model.recompute == "full":
        projection_input = e * a * (model.v_head_dim if model.is_mla else d) / t  # MLA: the values' width
        total = 2 * e * h / r + projection_input + _feed_forward_bytes(cfg, moe) + 2 * mask
        return total, 0.0, 0.0
    qkv_storage = 0.0 if (rope and expanded) else e * (a + 2 * g) * d / t  # some of Q, K, V is a view of it
    new_qkv = e * d / t * (a * int(rope) + (2 * a if expanded else g * int(rope)))
    logsumexp = 0.0 if model.recompute == "selective" else 4 * a / t
    attention = _norm_bytes(model, r, gpu) + e * h + qkv_storage + new_qkv + e * a * d / t + logsumexp + mask
    mlp = _norm_bytes(model, r, gpu) + _feed_forward_bytes(cfg, moe) + mask
    return attention + mlp, attention, mlp


def recompute_working_bytes(cfg: Config, gpu: GPU) -> float:
    """Full recompute rebuilds one phase of one layer in backward: that phase's activations, per token."""
    plain = replace(cfg, model=replace(cfg.model, recompute="none"))
    _, attention, mlp = layer_activation_bytes(plain, gpu)
    return max(attention, mlp, layer_activation_bytes(plain, gpu, moe=True)[2] if cfg.model.num_experts else 0.0)


def chunk_activation_bytes(cfg: Config, gpu: GPU, layers: int, first: bool, last: bool, moe_layers: int = 0) -> float:
    """Saved bytes per token of one model chunk holding ``layers`` blocks, ``moe_layers`` of them with experts (and
    the embedding / head)."""
    model, par = cfg.model, cfg.parallel
    e, t = weight_bytes(cfg), par.tp
    r = sequence_shard(cfg)
    h = model.hidden_size
    total = (layers - moe_layers) * layer_activation_bytes(cfg, gpu)[0]
    total += moe_layers * layer_activation_bytes(cfg, gpu, moe=True)[0] if moe_layers else 0.0
    if layers and model.position_embedding == "rope":
        total += 8 * model.rope_dim  # the tables cover the rotated dimensions only
    if first:
        total += 8 + (1 if t > 1 else 0) + _dropout_mask_bytes(cfg, gpu)
    elif e != 4 and model.recompute != "full":
        total += e * h / r
    if last:
        head = _norm_bytes(model, r, gpu) + e * h + 4 * model.padded_vocab_size(t) / t + 9
        # each MTP module: its block, its token ids, two more norms, the concatenation the projection reads, its head
        block = layer_activation_bytes(cfg, gpu, moe=model.is_moe_layer(model.num_layers))[0]
        total += head + model.mtp_num_layers * (block + 8 + 2 * _norm_bytes(model, r, gpu) + 2 * e * h / r + head)
    return total


def loss_transient_bytes(cfg: Config) -> float:
    """Extra bytes per token while the loss's forward runs, beyond the softmax it keeps."""
    e, t = weight_bytes(cfg), cfg.parallel.tp
    model = cfg.model
    vocab = model.padded_vocab_size(t) / t
    fp32_copy = e != 4 or model.padded_vocab_size(t) > model.vocab_size  # a cast, or the masked copy
    return (e + (4 if fp32_copy else 0) + 4) * vocab
