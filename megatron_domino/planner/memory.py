"""Per-GPU memory of a training layout, stage by stage, from the config alone.

Static state, per parameter held by the rank (its TP shard of its pipeline chunks), following
``optim.distributed_optimizer``:
- weights: 2 B (bf16/fp16) or 4 B (fp32);
- gradients: a 4 B fp32 buffer (``accumulate_grads_in_fp32``, else the weight dtype). ZeRO-1/2 add the
  reduced shard beside it: 1/(dp*cp), since context-parallel ranks hold the same weights and their
  gradients reduce with the data-parallel ones. ZeRO-2 frees a bucket's full gradient once it is
  reduced, but it lives from the step's first backward to its last, so with more than one micro-batch
  it is all there at the peak; with one micro-batch only about one bucket is;
- optimizer: fp32 master (4 B, only for 16-bit weights) + Adam's two moments (8 B; SGD momentum 4 B),
  divided by dp*cp under ZeRO >= 1.
Mixture of experts: a rank holds its ep share of the experts, whose ZeRO shards span dp*cp/ep ranks (``moe.py``).

Activations: the bytes autograd saves for backward, per micro-batch, counted tensor by tensor for
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

Selective recompute drops the logsumexp (SDPA's other inputs are the checkpoint's inputs and its output
is the projection's input, so nothing else). Full recompute keeps, per layer, each phase's input
(2e*h/r), the two projection inputs (e*a*d/t + e*f/t) and the dropout masks; one phase's activations
are rebuilt at a time in backward (counted as transient). Per model chunk and micro-batch, the first
stage adds token ids (8 B/token) and an embedding dropout mask; RoPE adds fp32 cos/sin (8d B/token);
the last stage adds a norm, the head input (e*h) and the loss's fp32 softmax (4V/t) with int64
targets; other stages keep the received input (e*h/r) when it is not the first norm's own saved input.

Context parallelism (cp > 1) and documents. A rank holds s/cp tokens of each sequence, so every
per-token term above counts s/cp tokens. Ring attention (``models/ring_attention.py``) runs the same
flash-style kernels block by block and saves what they save for the local tokens (the K/V blocks received
from other ranks are sent on, not kept). Its backward peak is transient, beside full recompute's rebuilt
phase: the fp32 dQ accumulator (4a*d/t), the K/V block in use and the next one (4e*g*d/t), their fp32
dK/dV, in use and received (16g*d/t), and under GQA the K/V repeated per query head (2e*a*d/t).
Document masking (``data.reset_attention_mask``) runs one causal kernel call per document on slices of
the same Q, K and V: its cost is the O(L) offsets, so there is no L^2 term with or without CP.

In flight: a rank holds the activations of every micro-batch whose forward has run and backward has
not. 1F1B: min(pp - rank, m) on rank ``rank``; interleaved: Megatron's warm-up count + 1 chunk-micro-
batches (``pipeline.schedules.interleaved_warmup``), each sized by the rank's largest chunk.

Transient peaks: when the loss's forward computes its softmax it holds the logits (e), one fp32 copy of
them (16-bit runs, or the masked copy of padded vocabularies: the masked one replaces the plain fp32 copy,
which is dropped as it is made) and the shifted logits next to the softmax (the rehearsal measured exactly
this: ``tools/rehearse.py``); backward temporaries (gradients of one layer's tensors) are not counted. The fixed ``overhead`` (hardware.py) covers the
CUDA context, NCCL buffers and fragmentation.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache, wraps

from ..config.schema import Config, ModelConfig
from ..models.counters import norm_parameters
from ..pipeline.program import virtual_stage
from ..pipeline.schedules import interleaved_warmup, schedule_kind
from ..pipeline.stages import layer_partition
from .hardware import GPU
from .moe import expert_replicas, layer_parameters, routed_activation_bytes, whole_experts

GIB = 2**30


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one GPU of pipeline rank ``rank`` (the worst TP rank of it)."""

    rank: int
    params: float
    grads: float
    optimizer: float
    activations: float  # all micro-batches in flight
    transient: float
    overhead: float
    in_flight: int  # micro-batches (chunk-micro-batches when interleaved) whose activations are held

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient + self.overhead

    def breakdown(self) -> str:
        """"params 2.7 + grads 5.5 + ... = 66.2 GiB" (MiB for totals under 1 GiB: the tiny CPU runs)."""
        scale, unit = (GIB, "GiB") if self.total >= GIB else (2**20, "MiB")
        parts = [("params", self.params), ("grads", self.grads), ("optim", self.optimizer),
                 ("act", self.activations), ("transient", self.transient), ("overhead", self.overhead)]
        terms = " + ".join(f"{name} {value / scale:.1f}" for name, value in parts)
        return f"{terms} = {self.total / scale:.1f} {unit}"


def weight_bytes(cfg: Config) -> int:
    return 2 if (cfg.train.bf16 or cfg.train.fp16) else 4


def per_model_layout(fn):
    """Memoise ``fn(cfg)``, a function of the model, its pipeline split and tp / ep only: a search asks for the same few
    values thousands of times. Results are shared, so they are tuples."""
    results: dict = {}

    @wraps(fn)
    def memoised(cfg: Config):
        par = cfg.parallel
        model = tuple(tuple(v) if isinstance(v, list) else v for v in vars(cfg.model).values())  # moe_layer_freq
        key = (model, par.tp, par.pp, par.ep, par.expert_tp, par.virtual_pp, par.pipeline_partition,
               tuple(par.pipeline_layout or ()))
        if key not in results:
            results[key] = fn(cfg)
        return results[key]

    return memoised


@per_model_layout
def stage_layers(cfg: Config) -> tuple:
    """``layer_partition``, memoised."""
    return tuple(tuple(layers) for layers in layer_partition(cfg))


# ----- parameters --------------------------------------------------------------------------------
@per_model_layout
def rank_parameter_split(cfg: Config) -> tuple[tuple[float, float], ...]:
    """(dense, expert) parameters held by one rank of each pipeline rank (embedding on the first, head on the last);
    experts are those of its ep share (``moe.layer_parameters``)."""
    model, par = cfg.model, cfg.parallel
    partition = stage_layers(cfg)
    stages = par.pp * par.virtual_pp
    embedding = model.padded_vocab_size(par.tp) // par.tp * model.hidden_size
    layer = cache(lambda i: layer_parameters(model, i, par.tp, par.ep, whole_experts(par)))
    totals = []
    for rank in range(par.pp):
        dense = experts = 0.0
        for chunk in range(par.virtual_pp):
            stage = virtual_stage(rank, chunk, par.pp)
            for i in partition[stage]:
                dense, experts = dense + layer(i)[0], experts + layer(i)[1]
            if stage == 0:
                dense += embedding + (model.max_positions * model.hidden_size
                                      if model.position_embedding == "learned" else 0)
            if stage == stages - 1:
                dense += norm_parameters(model)
                if not (model.tie_embeddings and stages == 1):
                    dense += embedding
        totals.append((dense, experts))
    return tuple(totals)


@per_model_layout
def rank_parameters(cfg: Config) -> tuple[float, ...]:
    """Parameters held by one rank of each pipeline rank, dense and expert together."""
    return tuple(dense + experts for dense, experts in rank_parameter_split(cfg))


def static_bytes(cfg: Config, params: float, dp: int, experts: float = 0.0) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes for ``params`` parameters on one GPU, ``experts`` of them expert
    parameters: ZeRO shards dense state over dp*cp and expert state over the expert-data-parallel group."""
    opt, e = cfg.optimizer, weight_bytes(cfg)
    grad_e = 4 if opt.accumulate_grads_in_fp32 else e
    moments = 8 if opt.name == "adamw" else (4 if opt.momentum > 0 else 0)
    grads = state = bucketed = 0.0
    for count, shards in ((params - experts, dp * cfg.parallel.cp), (experts, expert_replicas(cfg, dp))):
        zero = opt.zero_stage if shards > 1 else 0  # one replica: the shard is the whole (as the optimizer does)
        full_grads = count * grad_e
        if zero == 0:
            grads += full_grads
        elif zero == 1 or cfg.train.num_microbatches(dp) > 1:
            grads += full_grads + full_grads / shards
        else:
            grads, bucketed = grads + full_grads / shards, bucketed + full_grads
        group_state = count * ((4 if e != 4 else 0) + moments)
        state += group_state / shards if zero >= 1 else group_state
    return params * e, grads + min(bucketed, opt.bucket_size_mb * 2**20), state


# ----- activations -------------------------------------------------------------------------------
def _norm_bytes(model: ModelConfig, shard: int, gpu: GPU) -> float:
    h = model.hidden_size
    if model.norm == "layernorm":
        return (4 * h + 8) / shard
    return ((4 if gpu.is_cuda else 8) * h + 4) / shard


def _dropout_mask_bytes(cfg: Config, gpu: GPU) -> float:
    """Bytes per token of one hidden-state dropout mask (0 without dropout)."""
    if cfg.model.hidden_dropout == 0:
        return 0.0
    shard = cfg.parallel.tp if cfg.parallel.sequence_parallel and cfg.parallel.tp > 1 else 1
    return (1 if gpu.is_cuda else weight_bytes(cfg)) * cfg.model.hidden_size / shard


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
    r = t if par.sequence_parallel and t > 1 else 1
    h, d = model.hidden_size, model.head_dim
    a, g = model.num_attention_heads, model.query_groups
    rope = model.position_embedding == "rope"
    expanded = g < a and model.attention_backend == "efficient"  # K and V copied per query head
    mask = _dropout_mask_bytes(cfg, gpu)
    if model.recompute == "full":
        total = 2 * e * h / r + e * a * d / t + _feed_forward_bytes(cfg, moe) + 2 * mask
        return total, 0.0, 0.0
    qkv_storage = 0.0 if (rope and expanded) else e * (a + 2 * g) * d / t  # some of Q, K, V is a view of it
    new_qkv = e * d / t * (a * int(rope) + (2 * a if expanded else g * int(rope)))
    logsumexp = 0.0 if model.recompute == "selective" else 4 * a / t
    attention = _norm_bytes(model, r, gpu) + e * h + qkv_storage + new_qkv + e * a * d / t + logsumexp + mask
    mlp = _norm_bytes(model, r, gpu) + _feed_forward_bytes(cfg, moe) + mask
    return attention + mlp, attention, mlp


def _recompute_working_bytes(cfg: Config, gpu: GPU) -> float:
    """Full recompute rebuilds one phase of one layer in backward: that phase's activations, per token."""
    plain = replace(cfg, model=replace(cfg.model, recompute="none"))
    _, attention, mlp = layer_activation_bytes(plain, gpu)
    return max(attention, mlp, layer_activation_bytes(plain, gpu, moe=True)[2] if cfg.model.num_experts else 0.0)


def chunk_activation_bytes(cfg: Config, gpu: GPU, layers: int, first: bool, last: bool, moe_layers: int = 0) -> float:
    """Saved bytes per token of one model chunk holding ``layers`` blocks, ``moe_layers`` of them with experts (and
    the embedding / head)."""
    model, par = cfg.model, cfg.parallel
    e, t = weight_bytes(cfg), par.tp
    r = t if par.sequence_parallel and t > 1 else 1
    h = model.hidden_size
    total = (layers - moe_layers) * layer_activation_bytes(cfg, gpu)[0]
    total += moe_layers * layer_activation_bytes(cfg, gpu, moe=True)[0] if moe_layers else 0.0
    if layers and model.position_embedding == "rope":
        total += 8 * model.head_dim
    if first:
        total += 8 + (1 if t > 1 else 0) + _dropout_mask_bytes(cfg, gpu)
    elif e != 4 and model.recompute != "full":
        total += e * h / r
    if last:
        total += _norm_bytes(model, r, gpu) + e * h + 4 * model.padded_vocab_size(t) / t + 9
    return total


def ring_transient_bytes(cfg: Config) -> float:
    """Bytes per local token that ring attention's backward holds beyond the saved tensors; 0 at cp 1."""
    if cfg.parallel.cp == 1:
        return 0.0
    model, e = cfg.model, weight_bytes(cfg)
    heads, groups = model.num_attention_heads, model.query_groups
    repeated = 2 * e * heads if groups < heads else 0
    return (4 * heads + 4 * e * groups + 16 * groups + repeated) * model.head_dim / cfg.parallel.tp


def loss_transient_bytes(cfg: Config) -> float:
    """Extra bytes per token while the loss's forward runs, beyond the softmax it keeps."""
    e, t = weight_bytes(cfg), cfg.parallel.tp
    model = cfg.model
    vocab = model.padded_vocab_size(t) / t
    fp32_copy = e != 4 or model.padded_vocab_size(t) > model.vocab_size  # a cast, or the masked copy
    return (e + (4 if fp32_copy else 0) + 4) * vocab


def in_flight(cfg: Config, dp: int) -> list[int]:
    """Micro-batches (chunk-micro-batches when interleaved) whose activations each pipeline rank holds at its peak."""
    pp, v = cfg.parallel.pp, cfg.parallel.virtual_pp
    m = cfg.train.num_microbatches(dp)
    kind = schedule_kind(pp, v, cfg.parallel.pipeline_schedule)
    if kind == "none":
        return [1]
    if kind == "1f1b":
        return [min(pp - rank, m) for rank in range(pp)]
    if kind == "zb-h1":  # each rank holds a micro-batch from F to W: 1F1B's peak, on every rank
        return [min(pp, m)] * pp
    return [min(interleaved_warmup(pp, rank, m, v) + 1, m * v) for rank in range(pp)]


# ----- the estimate ------------------------------------------------------------------------------
def estimate_stages(cfg: Config, dp: int, gpu: GPU) -> list[StageMemory]:
    """Memory of every pipeline rank for the layout in ``cfg`` with data-parallel size ``dp``."""
    par = cfg.parallel
    partition = stage_layers(cfg)
    stages = par.pp * par.virtual_pp
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length / par.cp  # this rank's part of each sequence
    attention = ring_transient_bytes(cfg)
    if cfg.model.recompute == "full":
        attention += _recompute_working_bytes(cfg, gpu)
    flights = in_flight(cfg, dp)
    chunk_bytes = cache(lambda layers, first, last: chunk_activation_bytes(
        cfg, gpu, len(layers), first, last, sum(map(cfg.model.is_moe_layer, layers))))
    result = []
    for rank, (dense, experts) in enumerate(rank_parameter_split(cfg)):
        weights, grads, optimizer = static_bytes(cfg, dense + experts, dp, experts)
        chunks = [virtual_stage(rank, c, par.pp) for c in range(par.virtual_pp)]
        per_unit = max(chunk_bytes(tuple(partition[s]), s == 0, s == stages - 1) for s in chunks)
        transient = max(attention, loss_transient_bytes(cfg) if stages - 1 in chunks else 0.0)
        result.append(StageMemory(rank, weights, grads, optimizer, flights[rank] * per_unit * tokens,
                                  transient * tokens, gpu.overhead_gib * GIB, flights[rank]))
    return result


def estimate_memory(cfg: Config, dp: int, gpu: GPU) -> StageMemory:
    """The pipeline rank with the largest total: the one that decides whether the layout fits."""
    return max(estimate_stages(cfg, dp, gpu), key=lambda s: s.total)
