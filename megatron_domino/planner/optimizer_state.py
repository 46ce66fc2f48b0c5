"""Optimizer state per weight for each rule and precision (``optim/param_groups.py``, ``optim/low_precision.py``),
and which weights Muon steps: what ``memory.static_bytes`` multiplies by the weights of a rank's ZeRO shard.

Per weight of the shard: a master unless the weights are of the master's dtype (fp32 weights, or bf16 weights
with ``master_dtype: bf16``: the weights are the masters), plus 2 bytes of compensation for a compensated bf16
master, plus the moments: AdamW two of ``moments_dtype`` (4 or 2 bytes), SGD one fp32 momentum, Muon one momentum
on its matrices and AdamW's two on the rest (embeddings, head, norms, biases, routers). Offloaded, the master (a
copy of its own) and Adam's moments are in host memory; Muon's momentum stays on the device, where the
orthogonalization runs.

Which weights are Muon's: the blocks' 2-D weights (attention, MLP, experts) and MTP's projection; AdamW keeps the
embedding (and positions), the head, the norms, the routers and the biases, counted here from the config.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config.schema import Config
from ..models.counters import mtp_module_parameters, norm_parameters
from ..pipeline.schedules import chunk_stage
from .layout_cache import per_model_layout, stage_layers

BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class StateBytes:
    """Bytes per weight of a ZeRO shard: on the device, and, of an offloaded one, on the device and the host."""

    device: float
    offloaded_device: float
    offloaded_host: float


def state_bytes(opt, weight_bytes: int, muon_share: float) -> StateBytes:
    """``muon_share``: the fraction of these weights Muon steps (0 unless ``optimizer.name`` is muon)."""
    master, moment = BYTES[opt.master_dtype], BYTES[opt.moments_dtype]
    compensation = 2 if opt.master_dtype == "bf16" and opt.master_rounding == "compensated" else 0
    if opt.name == "sgd":
        muon, adam = 0.0, 4.0 if opt.momentum > 0 else 0.0
    elif opt.name == "muon":
        muon, adam = muon_share * moment, (1 - muon_share) * 2 * moment
    else:
        muon, adam = 0.0, 2.0 * moment
    copy = 0 if master == weight_bytes else master
    return StateBytes(copy + compensation + muon + adam, muon, master + compensation + adam)


def _layer_adamw(model, layer: int) -> float:
    """A block's weights AdamW keeps under Muon (per rank: all replicated): two norms, the router, the biases
    (row-parallel ones whole, the column-parallel ones' share is small and counted whole too)."""
    h, moe = model.hidden_size, model.is_moe_layer(layer)
    biases = 0
    if model.bias:
        ffn = model.moe_ffn_size if moe else model.ffn_size
        biases = 2 * h + (model.num_attention_heads + 2 * model.query_groups) * model.head_dim + ffn
    return 2 * norm_parameters(model) + (model.num_experts * h if moe else 0) + biases


@per_model_layout
def _rank_adamw(cfg: Config) -> tuple[float, ...]:
    """Per pipeline rank, the weights AdamW keeps under Muon."""
    model, par = cfg.model, cfg.parallel
    partition, stages = stage_layers(cfg), par.pp * par.virtual_pp
    embedding = model.padded_vocab_size(par.tp) // par.tp * model.hidden_size
    result = []
    for rank in range(par.pp):
        total = 0.0
        for chunk in range(par.virtual_pp):
            stage = chunk_stage(par, rank, chunk)
            total += sum(_layer_adamw(model, i) for i in partition[stage])
            if stage == 0:
                total += embedding + (model.max_positions * model.hidden_size
                                      if model.position_embedding == "learned" else 0)
            if stage == stages - 1:
                total += norm_parameters(model) + embedding * (not (model.tie_embeddings and stages == 1))
                total += model.mtp_num_layers * (mtp_module_parameters(model) - 2 * model.hidden_size ** 2
                                                 + _layer_adamw(model, model.num_layers))
        result.append(total)
    return tuple(result)


def muon_share(cfg: Config, rank: int, dense: float) -> float:
    """The fraction of pipeline rank ``rank``'s ``dense`` weights that Muon steps (experts: all of them)."""
    if cfg.optimizer.name != "muon" or dense <= 0:
        return 0.0
    return max(0.0, 1 - _rank_adamw(cfg)[rank] / dense)
