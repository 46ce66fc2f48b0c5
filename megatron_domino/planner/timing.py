"""Step time of a training layout: compute, exposed communication and the pipeline bubble.

A first-order model for ranking layouts, not a simulator. Assumptions, each a knob where it is a guess:

Compute. ``counters.flops_per_token`` (forward + backward, attention over the full s x s square) per
token, at ``efficiency`` (default 0.5) of the GPU's dense peak. Full recompute re-runs each block's
forward (+1/3 of the block's FLOPs); selective recompute re-runs attention's score and weighted sum
(4*s*a*d per token and layer). The slowest pipeline rank (most layers, plus the output head on the
last) sets the pace; every rank waits for it.

Tensor parallelism. Each block runs 2 all-reduces of the [micro batch, s, h] activations forward and
2 backward (sequence parallelism: an all-gather and a reduce-scatter in place of each, the same
bytes; its full recompute repeats the 2 forward all-gathers). A ring all-reduce of B bytes over t
ranks costs 2*(t-1)/t * B / bandwidth (all-gather, reduce-scatter: half that), with NVLink bandwidth
when the TP group sits inside one node and InfiniBand otherwise; latency is ignored. Domino hides
``domino_hidden`` (0.9) of it with the row split (micro batch >= 2) and ``domino_column_hidden``
(0.5, a guess: only one weight's pieces overlap) with the column split, which is what a row split
runs at micro batch 1. With sequence parallelism Domino overlaps the reduce-scatters (forward) and the
input-gradient reduce-scatters (backward) but not the all-gathers each phase starts with, so it hides
half of that share.

Pipeline. 1F1B's bubble is (pp - 1) / virtual_pp micro-batch times (Narayanan et al. 2021). Each
micro-batch crosses virtual_pp stage boundaries, receiving its activation forward and its gradient
backward ([micro batch, s / (tp if SP), h] per TP rank), fully exposed.

Data parallelism. Once per step: all-reduce of the gradients (ZeRO-0), or reduce-scatter of the
gradients then all-gather of the updated weights (ZeRO-1/2), over the DP group's link. With
``optimizer.overlap_grad_reduce`` the gradient reduction overlaps the last micro-batch's backward
(at most its length); the weight all-gather follows the optimizer step and is exposed. The optimizer
step itself (memory bound) is not counted.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..config.schema import Config
from ..models.counters import flops_per_token
from ..parallel.topology import Topology
from ..pipeline.schedules import virtual_stage
from ..pipeline.stages import layer_partition
from .hardware import GPU
from .memory import rank_parameters, weight_bytes


@dataclass(frozen=True)
class TimingAssumptions:
    efficiency: float = 0.5  # achieved share of peak FLOP/s
    domino_hidden: float = 0.9  # share of TP communication Domino's row split hides
    domino_column_hidden: float = 0.5  # share the column split hides (micro batch 1)


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on the slowest pipeline rank."""

    compute: float  # forward + backward (+ recompute) of every micro-batch
    bubble: float  # pipeline fill and drain
    tp_exposed: float  # TP communication not hidden
    tp_hidden: float  # TP communication Domino hides (not in total)
    pp_comm: float  # stage-to-stage transfers
    dp_exposed: float  # DP reduction and weight gather not overlapped

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp_exposed + self.pp_comm + self.dp_exposed


def _link(topology: Topology, axis: str, gpus_per_node: int, gpu: GPU) -> float:
    """Bandwidth (bytes/s) of one group along ``axis``: NVLink when it lies inside one node."""
    members = [topology.rank_of(**{axis: i}) for i in range(topology.sizes[axis])]
    inside = len({rank // gpus_per_node for rank in members}) == 1
    return (gpu.intra_node_gbps if inside else gpu.inter_node_gbps) * 1e9


def _all_reduce(nbytes: float, ranks: int, bandwidth: float) -> float:
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth if ranks > 1 else 0.0


def _rank_flops_per_token(cfg: Config) -> list[float]:
    """Training FLOPs per token that each pipeline rank computes, summed over its TP ranks (recompute included)."""
    model, par = cfg.model, cfg.parallel
    s = model.seq_length
    head = flops_per_token(replace(model, num_layers=0), s)
    per_layer = (flops_per_token(model, s) - head) / model.num_layers
    attention = (flops_per_token(model, s) - flops_per_token(model, 0)) / model.num_layers
    per_layer += {"full": per_layer / 3, "selective": attention / 3}.get(model.recompute, 0.0)
    partition = layer_partition(cfg)
    last = par.pp * par.virtual_pp - 1
    totals = []
    for rank in range(par.pp):
        stages = [virtual_stage(rank, c, par.pp) for c in range(par.virtual_pp)]
        totals.append(sum(len(partition[st]) for st in stages) * per_layer + (head if last in stages else 0.0))
    return totals


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
    topology = Topology(par.tp * par.pp * dp, par.tp, par.pp, dp, par.virtual_pp, par.order)
    e, m = weight_bytes(cfg), train.num_microbatches(dp)
    tokens = train.micro_batch_size * model.seq_length
    activation = tokens * model.hidden_size * e
    sp = par.sequence_parallel and par.tp > 1

    flops = _rank_flops_per_token(cfg)
    slowest = max(range(par.pp), key=lambda r: flops[r])
    compute_mb = flops[slowest] * tokens / par.tp / (gpu.peak_tflops * 1e12 * assumptions.efficiency)
    partition = layer_partition(cfg)
    layers = sum(len(partition[virtual_stage(slowest, c, par.pp)]) for c in range(par.virtual_pp))
    reductions = 4 + (1 if sp and model.recompute == "full" else 0)
    tp_mb = layers * reductions * _all_reduce(activation, par.tp, _link(topology, "tp", gpus_per_node, gpu))
    hidden = _domino_hidden_share(cfg, assumptions)
    pp_mb = 0.0
    if par.pp > 1:
        transfer = activation / (par.tp if sp else 1) / _link(topology, "pp", gpus_per_node, gpu)
        pp_mb = 2 * par.virtual_pp * transfer
    per_microbatch = compute_mb + (1 - hidden) * tp_mb + pp_mb

    dp_exposed = 0.0
    if dp > 1:
        params = max(rank_parameters(cfg))
        bandwidth = _link(topology, "dp", gpus_per_node, gpu)
        grad_bytes = params * (4 if cfg.optimizer.accumulate_grads_in_fp32 else e)
        if cfg.optimizer.zero_stage == 0:
            reduce, gather = _all_reduce(grad_bytes, dp, bandwidth), 0.0
        else:
            reduce = _all_reduce(grad_bytes, dp, bandwidth) / 2
            gather = _all_reduce(params * e, dp, bandwidth) / 2
        overlap = min(reduce, compute_mb * 2 / 3) if cfg.optimizer.overlap_grad_reduce else 0.0
        dp_exposed = reduce - overlap + gather

    return StepTime(compute=m * compute_mb, bubble=(par.pp - 1) / par.virtual_pp * per_microbatch,
                    tp_exposed=m * (1 - hidden) * tp_mb, tp_hidden=m * hidden * tp_mb, pp_comm=m * pp_mb,
                    dp_exposed=dp_exposed)


def model_flops_per_step(cfg: Config) -> float:
    """Useful FLOPs of one step (no recompute): what MFU counts."""
    return flops_per_token(cfg.model) * cfg.train.global_batch_size * cfg.model.seq_length
