"""Per-GPU memory of a training layout, stage by stage, from the config alone.

Static state, per parameter held by the rank (its TP shard of its pipeline chunks), following
``optim.distributed_optimizer``:
- weights: 2 B (bf16/fp16) or 4 B (fp32);
- gradients: a 4 B fp32 buffer (``accumulate_grads_in_fp32``, else the weight dtype) under ZeRO-0/1 (ZeRO-1
  reduce-scatters in place, so its shard lies inside the buffer); ZeRO-2 keeps the reduced shard alone,
  1/(dp*cp) (context-parallel ranks hold the same weights and their gradients reduce with the
  data-parallel ones), plus the full buckets being written and reduced, with any number of micro-batches:
  each gradient buffer (the dense weights', the experts') holds the bucket being written and at most
  ``optim.grad_buffer.IN_FLIGHT`` being reduced, and the IN_FLIGHT launched last in one backward pass are
  still held when the next begins. A bucket is ``bucket_size_mb`` or one weight larger than that: the largest
  1 + IN_FLIGHT dense ones are the word embedding's (first stage), the output layer's (last stage) and a
  block's widest weight's (an attention projection, the dense MLP's or the shared experts' fc1), the experts'
  an expert's fc1;
- optimizer: fp32 master (4 B, only for 16-bit weights) + Adam's two moments (8 B; SGD momentum 4 B),
  divided by dp*cp under ZeRO >= 1; with ``optimizer.offload`` the ``offload_fraction`` of it is in host
  memory, not on the device;
- ZeRO-3 divides the weights by dp*cp as well (vectors, a fraction of a percent, counted as sharded) and
  adds the gathered units: the largest 1 + ``prefetch_depth`` consecutive ones in a chunk's order (the
  embedding, each block, the head, and the embedding again where the tied head or MTP reads it:
  ``optim.weight_hooks.unit_orders``), or every unit of the stage when ``reshard_after_forward`` is off
  (``optim.weight_units``).
Mixture of experts: a rank holds its ep share of the experts, whose ZeRO shards span dp*cp/ep ranks (``moe.py``).

Activations per token: ``planner/activations.py``, tensor by tensor for this code.

In flight (``pipeline_model.in_flight``, the simulator's peaks): micro-batches, with one chunk per rank. A split
backward (zero-bubble schedules) also holds the gradients its I records until its W (``held_gradients.py``):
``pipeline_model.held_gradients`` micro-batches of them, added to the activations' peak (they coincide under ZB-H1).
With several chunks per rank (interleaved, the V's) the chunks are weighed apart, state by state of the rank's order
(``pipeline_model.chunk_states``): the first stage holds the token ids and embedding, the last the head's logits.
ZB-H1's loss forward sees one held gradient fewer (its order), so its transient counts less one; the states give
it exactly with several chunks. Rehearsals at pp 4, m 8
(``tools/rehearse.py``; GPT 1.3B and Llama-3 8B) agree within 2% on every rank of ZB-H1, ZB-V and DualPipeV.

Transient peaks: when the loss's forward computes its softmax it holds the logits (e), one fp32 copy of
them (16-bit runs, or the masked copy of padded vocabularies: the masked one replaces the plain fp32 copy,
which is dropped as it is made) and the shifted logits next to the softmax (the rehearsal measured exactly
this: ``tools/rehearse.py``); backward temporaries (gradients of one layer's tensors) are not counted. The
other transient, where larger: attention's context-parallel backward (ring blocks and gradients, all-to-all
buffers: ``context_parallel.py``) beside full recompute's rebuilt phase. The fixed ``overhead`` (hardware.py)
covers the CUDA context, NCCL buffers and fragmentation.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from ..config.schema import Config
from ..models.counters import mtp_module_parameters, norm_parameters
from ..optim.grad_buffer import IN_FLIGHT
from ..pipeline.schedules import chunk_stage, schedule_kind
from .activations import chunk_activation_bytes, loss_transient_bytes, recompute_working_bytes, weight_bytes
from .context_parallel import context_parallel_transient_bytes
from .hardware import GPU
from .layout_cache import per_model_layout, stage_layers  # noqa: F401 - timing.py takes them from here
from .held_gradients import chunk_held_bytes
from .pipeline_model import chunk_states, chunks_peak, held_gradients, in_flight
from .moe import expert_replicas, layer_parameters, whole_experts
from .optimizer_state import muon_share, state_bytes

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
    in_flight: int  # micro-batches (chunk-micro-batches with several chunks per rank) whose activations are held
    host: float = 0.0  # optimizer state offloaded to host memory (optimizer.offload), not on the GPU
    held: float = 0.0  # gradients a split backward's I records and its W frees (zero-bubble schedules)

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.held + self.transient
                + self.overhead)

    def breakdown(self) -> str:
        """"params 2.7 + grads 5.5 + ... = 66.2 GiB" (MiB for totals under 1 GiB: the tiny CPU runs)."""
        scale, unit = (GIB, "GiB") if self.total >= GIB else (2**20, "MiB")
        parts = [("params", self.params), ("grads", self.grads), ("optim", self.optimizer),
                 ("act", self.activations)] + [("held", self.held)] * bool(self.held) + [
                 ("transient", self.transient), ("overhead", self.overhead)]
        terms = " + ".join(f"{name} {value / scale:.1f}" for name, value in parts)
        host = f" (+ {self.host / scale:.1f} {unit} of optimizer state in host memory)" if self.host else ""
        return f"{terms} = {self.total / scale:.1f} {unit}{host}"


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
            stage = chunk_stage(par, rank, chunk)
            for i in partition[stage]:
                dense, experts = dense + layer(i)[0], experts + layer(i)[1]
            if stage == 0:
                dense += embedding + (model.max_positions * model.hidden_size
                                      if model.position_embedding == "learned" else 0)
            if stage == stages - 1:
                dense += norm_parameters(model)
                if not (model.tie_embeddings and stages == 1):
                    dense += embedding
                for k in range(model.mtp_num_layers):  # MTP: a block, three norms, the projection (replicated)
                    dense, experts = dense + layer(model.num_layers + k)[0], experts + layer(model.num_layers + k)[1]
                    dense += mtp_module_parameters(model)
                if model.mtp_num_layers and stages > 1 and not model.tie_embeddings:
                    dense += embedding  # MTP's copy of the word embedding
        totals.append((dense, experts))
    return tuple(totals)


@per_model_layout
def rank_parameters(cfg: Config) -> tuple[float, ...]:
    """Parameters held by one rank of each pipeline rank, dense and expert together."""
    return tuple(dense + experts for dense, experts in rank_parameter_split(cfg))


def static_bytes(cfg: Config, params: float, dp: int, experts: float = 0.0,
                 rank: int = 0) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer state, offloaded optimizer state) bytes for ``params`` parameters on one
    GPU of pipeline rank ``rank``, ``experts`` of them expert parameters: ZeRO shards dense state over dp*cp and
    expert state over the expert-data-parallel group; the last is in host memory."""
    opt, e = cfg.optimizer, weight_bytes(cfg)
    grad_e = 4 if opt.accumulate_grads_in_fp32 else e
    grads = state = host = weights = 0.0
    offloaded = opt.offload_fraction if opt.offload else 0.0
    bucket = opt.bucket_size_mb * 2**20
    dense_widest, expert_widest = bucket_weights(cfg)[rank]
    buckets = (sum(max(bucket, w * grad_e) for w in dense_widest),  # a weight is never cut in two
               (1 + IN_FLIGHT) * max(bucket, expert_widest * grad_e))
    for count, shards, held, share in ((params - experts, dp * cfg.parallel.cp, buckets[0],
                                        muon_share(cfg, rank, params - experts)),
                                       (experts, expert_replicas(cfg, dp), buckets[1], 1.0)):
        zero = opt.zero_stage if shards > 1 else 0  # one replica: the shard is the whole (as the optimizer does)
        full_grads = count * grad_e
        if zero <= 1:  # ZeRO-1 reduce-scatters in place: its shard lies inside the full buffer
            grads += full_grads
        else:  # ZeRO-2: the shard, and full buckets only while they are written and reduced
            grads += full_grads / shards + min(full_grads, held)
        # per weight: masters and moments by rule and precision (``optimizer_state``); an offloaded weight gets a
        # master of its own in host memory, and keeps only Muon's momentum on the device
        owners = shards if zero >= 1 else 1  # ranks that share this state
        per = state_bytes(opt, e, share if opt.name == "muon" else 0.0)
        state += count * ((1 - offloaded) * per.device + offloaded * per.offloaded_device) / owners
        host += offloaded * count * per.offloaded_host / owners
        weights += count * e / (shards if zero == 3 else 1)
    if opt.zero_stage == 3 and dp * cfg.parallel.cp > 1:  # the gathered window (the whole stage without resharding)
        weights += params * e if not opt.reshard_after_forward else gathered_window(cfg, rank) * e
    return weights, grads, state, host


def widest_weights(model, tp: int, whole: bool = False) -> tuple[float, float]:
    """Elements of a block's widest dense weight and of its widest expert weight (0 without experts) on a TP
    rank: an attention projection (MLA's down-projection is whole on every rank), the dense MLP's or the shared
    experts' fc1 (SwiGLU's gate and up in one), an expert's fc1 (whole experts: not split by tp)."""
    h, a, parts = model.hidden_size, model.num_attention_heads, 2 if model.activation == "swiglu" else 1
    if model.is_mla:
        q_rank, nope = model.q_lora_rank, model.qk_nope_head_dim
        attention = [h * ((q_rank or 0) + model.kv_lora_rank + model.qk_rope_head_dim),
                     (q_rank or h) * a * model.key_head_dim / tp,
                     model.kv_lora_rank * a * (nope + model.v_head_dim) / tp, a * model.v_head_dim * h / tp]
    else:
        attention = [h * (a + 2 * model.query_groups) * model.head_dim / tp, a * model.head_dim * h / tp]
    moe = [model.is_moe_layer(i) for i in range(model.num_layers)]
    widths = [model.ffn_size] * (not all(moe)) + [model.moe_shared_experts * model.moe_ffn_size] * any(moe)
    expert = h * parts * model.moe_ffn_size / (1 if whole else tp) if any(moe) else 0.0
    return max(attention + [h * parts * f / tp for f in widths]), expert


@per_model_layout
def bucket_weights(cfg: Config) -> tuple[tuple[tuple[float, ...], float], ...]:
    """Per pipeline rank: (elements of the weights of its 1 + IN_FLIGHT largest dense gradient buckets, of its
    widest expert weight). The largest are the word embedding's (first stage) and the output layer's (last stage;
    one weight when tied on one stage), the others a block's widest weight; the embedding's, reduced last, is
    still held when the next backward pass writes the output layer's, its first."""
    model, par = cfg.model, cfg.parallel
    stages = par.pp * par.virtual_pp
    embedding = model.padded_vocab_size(par.tp) // par.tp * model.hidden_size
    block, expert = widest_weights(model, par.tp, whole_experts(par))
    result = []
    for rank in range(par.pp):
        held = {chunk_stage(par, rank, chunk) for chunk in range(par.virtual_pp)}
        alone = [embedding] * ((0 in held) + (stages - 1 in held and not (model.tie_embeddings and stages == 1)))
        result.append((tuple(sorted(alone + [block] * (1 + IN_FLIGHT), reverse=True)[:1 + IN_FLIGHT]), expert))
    return tuple(result)


@per_model_layout
def gather_units(cfg: Config) -> tuple[tuple[tuple[float, ...], ...], ...]:
    """Per pipeline rank, per model chunk: the elements of its ZeRO-3 gather units in forward order
    (``optim.weight_hooks.unit_orders``): the embedding, each block (dense and expert weights), the head (the
    output layer and whatever else the last stage holds beside its blocks: MTP's modules), and the embedding again
    where the tied head or MTP reads it. Backward's order is the reverse, without the input embedding."""
    model, par = cfg.model, cfg.parallel
    partition, stages = stage_layers(cfg), par.pp * par.virtual_pp
    first = model.padded_vocab_size(par.tp) // par.tp * model.hidden_size + (
        model.max_positions * model.hidden_size if model.position_embedding == "learned" else 0)
    layer = cache(lambda i: sum(layer_parameters(model, i, par.tp, par.ep, whole_experts(par))))
    result = []
    for rank, held in enumerate(rank_parameters(cfg)):
        chunks = [chunk_stage(par, rank, chunk) for chunk in range(par.virtual_pp)]
        blocks = [tuple(layer(i) for i in partition[stage]) for stage in chunks]
        head = held - sum(map(sum, blocks)) - first * (0 in chunks) - norm_parameters(model)  # the rest: the head's
        orders = []
        for stage, units in zip(chunks, blocks):
            order = ((first,) if stage == 0 else ()) + units
            if stage == stages - 1:
                order += (head,) if head > 0 else ()
                if stage == 0 and (model.tie_embeddings or model.mtp_num_layers):
                    order += (first,)
            orders.append(order)
        result.append(tuple(orders))
    return tuple(result)


def gathered_window(cfg: Config, rank: int) -> float:
    """Elements ZeRO-3 holds gathered at most on pipeline rank ``rank``: the touched unit and the
    ``prefetch_depth`` after it, in either pass (``optim.weight_units``)."""
    depth = 1 + cfg.optimizer.prefetch_depth
    return max((sum(order[i:i + depth]) for order in gather_units(cfg)[rank] for i in range(len(order))),
               default=0.0)


# ----- the estimate ------------------------------------------------------------------------------
def estimate_stages(cfg: Config, dp: int, gpu: GPU) -> list[StageMemory]:
    """Memory of every pipeline rank for the layout in ``cfg`` with data-parallel size ``dp``."""
    par = cfg.parallel
    partition = stage_layers(cfg)
    stages = par.pp * par.virtual_pp
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length / par.cp  # this rank's part of each sequence
    attention = context_parallel_transient_bytes(cfg)
    if cfg.model.recompute == "full":
        attention += recompute_working_bytes(cfg, gpu)
    flights, loss, held = in_flight(cfg, dp), loss_transient_bytes(cfg), held_gradients(cfg, dp)
    kind = schedule_kind(par.pp, par.virtual_pp, par.pipeline_schedule)
    states = (chunk_states(kind, par.pp, cfg.train.num_microbatches(dp), par.virtual_pp) if par.virtual_pp > 1
              else None)
    # per (blocks, MoE blocks, first, last): stages of a uniform split share one value
    chunk_bytes = cache(lambda layers, moe, first, last: chunk_activation_bytes(cfg, gpu, layers, first, last, moe))
    chunk_held = cache(lambda layers, moe, first, last: chunk_held_bytes(cfg, layers, first, last, moe))
    result = []
    for rank, (dense, experts) in enumerate(rank_parameter_split(cfg)):
        weights, grads, optimizer, host = static_bytes(cfg, dense + experts, dp, experts, rank)
        chunks = [chunk_stage(par, rank, c) for c in range(par.virtual_pp)]
        shapes = [(len(partition[s]), sum(map(cfg.model.is_moe_layer, partition[s])), s == 0, s == stages - 1)
                  for s in chunks]
        units, held_units = [chunk_bytes(*shape) for shape in shapes], [chunk_held(*shape) for shape in shapes]
        per_unit, per_held = max(units), max(held_units)
        if states is not None:  # several chunks of different sizes, counted state by state
            active, holding, transient, alive = chunks_peak(states[rank], units, held_units, loss, attention)
        else:
            active, holding, alive = flights[rank] * per_unit, held[rank] * per_held, flights[rank]
            last = loss if stages - 1 in chunks else 0.0
            if held[rank]:  # ZB-H1's loss forward runs before the I that records the last held gradient
                last = max(0.0, last - per_held)
            transient = max(attention, last)
        result.append(StageMemory(rank, weights, grads, optimizer, active * tokens, transient * tokens,
                                  gpu.overhead_gib * GIB, alive, host, holding * tokens))
    return result


def estimate_memory(cfg: Config, dp: int, gpu: GPU) -> StageMemory:
    """The pipeline rank with the largest total: the one that decides whether the layout fits."""
    return max(estimate_stages(cfg, dp, gpu), key=lambda s: s.total)
