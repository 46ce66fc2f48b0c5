"""Step time of a training layout: compute, exposed communication and the pipeline bubble.

A first-order model for ranking layouts, not a simulator. Assumptions, each a knob where it is a guess:

Compute. ``counters.flops_per_token`` (forward + backward, attention over the full s x s square; MoE
layers: their active experts) per token, at ``efficiency`` (default 0.5) of the GPU's dense peak. Full
recompute re-runs each block's forward (+1/3 of the block's FLOPs); selective recompute re-runs attention's
score and weighted sum (4*s*a*d per token and layer). A context-parallel rank computes s/cp tokens of each
sequence, each still attending over the whole causal prefix: 1/cp of every FLOP, attention included. The
slowest pipeline rank (most layers, plus the output head on the last) sets the pace; every rank waits for it.

Tensor parallelism. Each block runs 2 all-reduces of the [micro batch, s/cp, h] activations forward and
2 backward (sequence parallelism: an all-gather and a reduce-scatter in place of each, the same
bytes; its full recompute repeats the 2 forward all-gathers). A ring all-reduce of B bytes over t
ranks costs 2*(t-1)/t * B / bandwidth (all-gather, reduce-scatter: half that), with NVLink bandwidth
when the TP group sits inside one node and InfiniBand otherwise; latency is ignored. Domino hides
``domino_hidden`` (0.9) of it with the row split (micro batch >= 2) and ``domino_column_hidden``
(0.5, a guess: only one weight's pieces overlap) with the column split, which is what a row split
runs at micro batch 1. With sequence parallelism Domino overlaps the reduce-scatters (forward) and the
input-gradient reduce-scatters (backward) but not the all-gathers each phase starts with, so it hides
half of that share.

Context parallelism (``context_parallel.py``): per layer, the ring's K/V transfers that block attention does
not hide, and the all-to-alls of a2a and a2a+ring (exposed, but for ``a2a_hidden``), each over its group's link
with a latency per message. The dp x cp gradient reduction is under data parallelism below.

Pipeline. The bubble is the schedule's closed form in micro-batch times of the slowest rank (its record in
``pipeline/schedules/``, read by ``pipeline_model.py``:
pp - 1 for 1F1B, (pp - 1)/v interleaved, (pp - 1)/3 ZB-H1, (pp - 1)/6 ZB-V, (7pp - 5)/6 DualPipeV), each such
time being that rank's compute and exposed communication of one micro-batch. Transfers: every chunk of a rank
receives its activation forward and its gradient backward ([micro batch, s / cp / (tp if SP), h]), its sends
going out in the same batched groups, so a rank spends 2 virtual_pp transfers per micro-batch, fully exposed. A
micro-batch crosses v pp - 1 rank boundaries each way when interleaved and 2pp - 2 in the V (zb-v, dualpipev: the
turn on rank pp - 1 is local), but the V's middle ranks still receive into both chunks: the busiest rank's count
is the same.

Expert parallelism (MoE, ``moe.py``). The all-to-alls that carry tokens to their experts' ranks and back, on
the slowest pipeline rank's MoE layers, at the ep group's link (ep consecutive dp ranks), fully exposed.

Data parallelism. Once per step: all-reduce of the gradients (ZeRO-0), or reduce-scatter of the
gradients then all-gather of the updated weights (ZeRO-1/2), over the dp x cp group and its link (expert
parameters: over their dp*cp/ep replicas, every ep-th dp rank, and that group's link). With
``optimizer.overlap_grad_reduce`` the gradient reduction overlaps the last micro-batch's backward
(at most its length); the weight all-gather follows the optimizer step and is exposed. ZeRO-2 and 3
reduce-scatter in every micro-batch's backward instead. ZeRO-3 gathers no weights after the step but
all-gathers each layer's in every micro-batch: once in forward and once in backward (``reshard_after_forward``;
a split backward's W gathers a third time: every backward of ZB-H1 and ZB-V, a share pp / m of DualPipeV's),
while the previous layer computes (``prefetch_depth`` >= 1): only what exceeds the micro-batch's compute, and
the first layer's gather, are exposed; without prefetch all of it.
The optimizer step itself (memory bound) is not counted on the device.

CPU offload (``optimizer.offload``). The offloaded share of the rank's shard crosses PCIe twice (the fp32
gradient down, the fp32 master back: 8 bytes per weight at ``pcie_gbps``) and is stepped by the host's AdamW,
which streams ~28 bytes per weight (gradient, master and two moments read, three written) at ``host_gbps``,
this rank's share of the node's host memory bandwidth (a guess: 10 GB/s). The host thread runs behind the next
step's first forward (``overlap_offload_step``), which hides up to one micro-batch's forward, a third of its
compute; the rest is exposed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import product

from ..config.schema import Config
from ..models.counters import flops_per_token
from ..parallel.topology import Topology
from ..pipeline.schedules import chunk_stage, get, schedule_kind
from .context_parallel import Link, context_parallel_seconds
from .hardware import GPU
from .memory import per_model_layout, rank_parameter_split, stage_layers, weight_bytes
from .pipeline_model import pipeline_bubble
from .moe import all_to_all_seconds, expert_replicas, expert_sharers, one_layer_model


@dataclass(frozen=True)
class TimingAssumptions:
    efficiency: float = 0.5  # achieved share of peak FLOP/s
    domino_hidden: float = 0.9  # share of TP communication Domino's row split hides
    domino_column_hidden: float = 0.5  # share the column split hides (micro batch 1)
    host_gbps: float = 10.0  # CPU offload: one rank's share of the host memory bandwidth its AdamW streams
    pcie_gbps: float = 25.0  # CPU offload: host <-> device copies per GPU (PCIe 5 x16, achieved)
    a2a_hidden: float = 0.0  # share of CP's all-to-alls hidden behind attention (0: all exposed, a guess to revisit)
    nvlink_latency_us: float = 5.0  # start-up of one message inside a node (a guess, context_parallel.py)
    ib_latency_us: float = 15.0  # ... between nodes (a guess)


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on the slowest pipeline rank."""

    compute: float  # forward + backward (+ recompute) of every micro-batch
    bubble: float  # pipeline fill and drain
    tp_exposed: float  # TP communication not hidden
    tp_hidden: float  # TP communication Domino hides (not in total)
    cp_exposed: float  # CP's ring transfers not hidden behind block attention, and its all-to-alls
    cp_hidden: float  # CP communication hidden (not in total)
    pp_comm: float  # stage-to-stage transfers
    ep_exposed: float  # the MoE token all-to-alls of expert parallelism (never hidden)
    dp_exposed: float  # DP reduction and weight gather not overlapped
    host_exposed: float = 0.0  # CPU offload: the host's optimizer step not hidden behind the next forward

    @property
    def total(self) -> float:
        return (self.compute + self.bubble + self.tp_exposed + self.cp_exposed + self.pp_comm + self.ep_exposed
                + self.dp_exposed + self.host_exposed)


@lru_cache(maxsize=4096)
def _inside_one_node(sizes: tuple, order: str, group: tuple[str, ...], gpus_per_node: int) -> bool:
    """Whether rank 0's group of a tp x cp x pp x dp grid with expert-parallel size ep, expert TP and all-to-all
    groups of cp_a2a CP ranks (``sizes``) lies inside one node: the group along the axes ``group`` names, or one
    of Topology's named groups: ``("expert",)`` / ``("expert_dp",)`` (token exchange, expert replicas),
    ``("cp_a2a",)`` / ``("cp_ring",)`` (a2a+ring's all-to-all groups and the rings across them)."""
    tp, cp, pp, dp, ep, expert_tp, cp_a2a = sizes
    topology = Topology(tp * cp * pp * dp, tp, pp, dp, 1, order, cp=cp, ep=ep, expert_tp=expert_tp, cp_a2a=cp_a2a)
    if group in (("expert",), ("expert_dp",), ("cp_a2a",), ("cp_ring",)):
        members = getattr(topology, f"{group[0]}_groups")()[0]  # sorted: the first holds rank 0
    else:
        coordinates = product(*(range(topology.sizes[axis]) for axis in group))
        members = [topology.rank_of(**dict(zip(group, at))) for at in coordinates]
    return len({rank // gpus_per_node for rank in members}) == 1


def _all_reduce(nbytes: float, ranks: int, bandwidth: float) -> float:
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth if ranks > 1 else 0.0


def _rank_layers(cfg: Config, rank: int) -> list[int]:
    """The global layers pipeline rank ``rank`` runs, over its model chunks."""
    partition = stage_layers(cfg)
    return [i for c in range(cfg.parallel.virtual_pp) for i in partition[chunk_stage(cfg.parallel, rank, c)]]


@per_model_layout
def _rank_flops_per_token(cfg: Config) -> tuple[float, ...]:
    """Training FLOPs per token that each pipeline rank computes, summed over its TP ranks (recompute included);
    an MoE layer counts its active experts (``counters.flops_per_token``)."""
    model, par = cfg.model, cfg.parallel
    s, h = model.seq_length, model.hidden_size
    main = replace(model, mtp_num_layers=0)
    head = flops_per_token(replace(main, num_layers=0), s)
    attention = (flops_per_token(main, s) - flops_per_token(main, 0)) / model.num_layers

    def layer(moe: bool) -> float:
        flops = flops_per_token(one_layer_model(model, moe), s) - head
        return flops + {"full": flops / 3, "selective": attention / 3}.get(model.recompute, 0.0)

    per_layer = {moe: layer(moe) for moe in (False, True)}
    # multi-token prediction on the last stage: per module a block, its projection and the output head again
    head += model.mtp_num_layers * (per_layer[model.is_moe_layer(model.num_layers)]
                                    + 6 * (2 * h * h + model.vocab_size * h))
    last = par.pp * par.virtual_pp - 1
    totals = []
    for rank in range(par.pp):
        stages = [chunk_stage(par, rank, c) for c in range(par.virtual_pp)]
        layers = sum(per_layer[model.is_moe_layer(i)] for i in _rank_layers(cfg, rank))
        totals.append(layers + (head if last in stages else 0.0))
    return tuple(totals)


def _domino_hidden_share(cfg: Config, assumptions: TimingAssumptions) -> float:
    par = cfg.parallel
    if not par.domino or par.tp == 1:
        return 0.0
    rows = par.domino_split in ("row", "2d") and cfg.train.micro_batch_size >= 2
    share = assumptions.domino_hidden if rows else assumptions.domino_column_hidden
    return share / 2 if par.sequence_parallel else share


def estimate_step_time(cfg: Config, dp: int, gpu: GPU, gpus_per_node: int,
                       assumptions: TimingAssumptions = TimingAssumptions()) -> StepTime:
    """Seconds per step of the layout in ``cfg`` with data-parallel size ``dp`` (see the module docstring)."""
    model, par, train = cfg.model, cfg.parallel, cfg.train
    nested = par.cp_comm == "a2a+ring"
    sizes = (par.tp, par.cp, par.pp, dp, par.ep, par.expert_tp, par.cp_a2a_size if nested else 1)

    def link_of(*group: str) -> Link:
        """A group's bandwidth (bytes/s) and per-message latency (see ``_inside_one_node``): NVLink's when it lies
        inside one node, else InfiniBand's."""
        if _inside_one_node(sizes, par.order, group, gpus_per_node):
            return Link(1e9 * gpu.intra_node_gbps, 1e-6 * assumptions.nvlink_latency_us)
        return Link(1e9 * gpu.inter_node_gbps, 1e-6 * assumptions.ib_latency_us)

    def link(*group: str) -> float:
        return link_of(*group).bandwidth

    e, m = weight_bytes(cfg), train.num_microbatches(dp)
    tokens = train.micro_batch_size * model.seq_length / par.cp  # this rank's part of the micro-batch
    activation = tokens * model.hidden_size * e
    sp = par.sequence_parallel and par.tp > 1

    flops = _rank_flops_per_token(cfg)
    slowest = max(range(par.pp), key=lambda r: flops[r])
    rate = gpu.peak_tflops * 1e12 * assumptions.efficiency  # achieved FLOP/s
    compute_mb = flops[slowest] * tokens / par.tp / rate
    layers = _rank_layers(cfg, slowest)
    reductions = 4 + (1 if sp and model.recompute == "full" else 0)
    tp_mb = len(layers) * reductions * _all_reduce(activation, par.tp, link("tp"))
    hidden = _domino_hidden_share(cfg, assumptions)
    pp_mb = 0.0
    if par.pp > 1:
        transfer = activation / (par.tp if sp else 1) / link("pp")
        pp_mb = 2 * par.virtual_pp * transfer
    a2a_group, ring_group = (("cp_a2a",), ("cp_ring",)) if nested else (("cp",), ("cp",))
    cp_exposed, cp_hidden = (len(layers) * x for x in context_parallel_seconds(
        cfg, rate, link_of(*a2a_group), link_of(*ring_group), assumptions.a2a_hidden))
    ep_mb = 0.0
    if expert_sharers(par) > 1:
        moe_layers = sum(model.is_moe_layer(i) for i in layers)
        ep_mb = all_to_all_seconds(cfg, moe_layers, e, link("expert"))
    per_microbatch = compute_mb + (1 - hidden) * tp_mb + cp_exposed + pp_mb + ep_mb

    # context-parallel ranks reduce their gradients with the data-parallel ones; experts with their replicas only
    dense, experts = max(rank_parameter_split(cfg), key=sum)
    reduce = gather = layer_gathers = shard = 0.0
    zero3 = cfg.optimizer.zero_stage == 3
    for params, replicas, spans in ((dense, dp * par.cp, ("dp", "cp")),
                                    (experts, expert_replicas(cfg, dp), ("expert_dp",))):
        shard += params / replicas if cfg.optimizer.zero_stage else params
        if replicas == 1 or params == 0:
            continue
        bandwidth = link(*spans)
        grads = _all_reduce(params * (4 if cfg.optimizer.accumulate_grads_in_fp32 else e), replicas, bandwidth)
        if cfg.optimizer.zero_stage == 0:
            reduce += grads
        else:
            reduce += grads / 2
            if zero3:
                layer_gathers += _all_reduce(params * e, replicas, bandwidth) / 2
            else:
                gather += _all_reduce(params * e, replicas, bandwidth) / 2
    # ZeRO-2/3 reduce-scatter in every micro-batch's backward (they keep no whole gradient), the others once a step
    passes = m if cfg.optimizer.zero_stage >= 2 else 1
    overlap = min(reduce, compute_mb * 2 / 3) if cfg.optimizer.overlap_grad_reduce else 0.0
    if layer_gathers:
        gather += m * _exposed_layer_gathers(cfg, layer_gathers, compute_mb, len(layers), m)

    kind = schedule_kind(par.pp, par.virtual_pp, par.pipeline_schedule)
    bubble = pipeline_bubble(kind, par.pp, m, par.virtual_pp) * per_microbatch
    return StepTime(compute=m * compute_mb, bubble=bubble,
                    tp_exposed=m * (1 - hidden) * tp_mb, tp_hidden=m * hidden * tp_mb,
                    cp_exposed=m * cp_exposed, cp_hidden=m * cp_hidden, pp_comm=m * pp_mb,
                    ep_exposed=m * ep_mb, dp_exposed=passes * (reduce - overlap) + gather,
                    host_exposed=_exposed_host_step(cfg, shard, compute_mb, assumptions))


def _exposed_host_step(cfg: Config, shard: float, compute_mb: float, assumptions: TimingAssumptions) -> float:
    """Seconds of CPU offload's host step the next forward does not hide (see the module docstring); ``shard``:
    the weights whose optimizer state this rank steps."""
    opt = cfg.optimizer
    if not opt.offload or opt.zero_stage == 0:
        return 0.0
    weights = opt.offload_fraction * shard
    host = weights * 28 / (assumptions.host_gbps * 1e9) + weights * 8 / (assumptions.pcie_gbps * 1e9)
    return max(0.0, host - compute_mb / 3) if opt.overlap_offload_step else host


def _exposed_layer_gathers(cfg: Config, once: float, compute_mb: float, layers: int, m: int) -> float:
    """ZeRO-3's exposed weight all-gather seconds per micro-batch, ``once`` being one gather of every weight of
    the rank, ``m`` micro-batches per step (see the module docstring)."""
    opt, par = cfg.optimizer, cfg.parallel
    kind = schedule_kind(par.pp, par.virtual_pp, par.pipeline_schedule)
    passes = (2 if opt.reshard_after_forward else 1) + get(kind).regathers(par.pp, m)  # W re-gathers its share
    if opt.prefetch_depth == 0:
        return passes * once
    first = once / (layers + 2)  # the first unit of each pass (blocks, embedding and head)
    return max(0.0, passes * once - compute_mb) + passes * first


def model_flops_per_step(cfg: Config) -> float:
    """Useful FLOPs of one step (no recompute): what MFU counts."""
    return flops_per_token(cfg.model) * cfg.train.global_batch_size * cfg.model.seq_length
