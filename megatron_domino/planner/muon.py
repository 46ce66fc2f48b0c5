"""Muon's Newton-Schulz work per rank, from the config: the matrices of every pipeline stage owned as the optimizer
owns them (``optim/muon_plan.assign_owners``, longest first over the (TP rank, DP rank) slots), so that a plan, a
dry run or a test can read the busiest rank's FLOPs against the mean without building the model.

The loads depend only on the costs (equal costs are interchangeable), so enumerating each stage's weights in any
order gives the optimizer's loads."""
from __future__ import annotations

from dataclasses import dataclass

from ..config.schema import Config
from ..optim.muon_math import ns_flops
from ..optim.muon_plan import assign_owners
from ..pipeline.schedules import chunk_stage
from .layout_cache import stage_layers
from .moe import whole_experts


@dataclass(frozen=True)
class MuonBalance:
    flops: list[float]  # Newton-Schulz FLOPs per step of every rank (pipeline rank major, then TP, then DP)
    total: float

    @property
    def ratio(self) -> float:
        """The busiest rank's FLOPs over the mean (1.0: perfectly even)."""
        mean = sum(self.flops) / len(self.flops)
        return max(self.flops) / mean if mean else 1.0


def _cost(model, opt, shapes) -> float:
    return float(sum(ns_flops(rows, cols, opt.muon_ns_steps) for rows, cols in shapes))


def block_weights(model, opt) -> tuple[list[list[tuple[int, int]]], list[list[tuple[int, int]]]]:
    """(dense, one expert's) weights of a block, each as its logical matrices' (rows, cols)."""
    h, heads, d = model.hidden_size, model.num_attention_heads, model.head_dim
    if model.is_mla:
        qk, blocks = model.qk_nope_head_dim + model.qk_rope_head_dim, [model.kv_lora_rank + model.qk_rope_head_dim]
        q = [[(heads * qk, model.q_lora_rank)]] if model.q_lora_rank else [[(heads * qk, h)]]
        attention = [[(b, h) for b in ([model.q_lora_rank] if model.q_lora_rank else []) + blocks], *q,
                     [(heads * (model.qk_nope_head_dim + model.v_head_dim), model.kv_lora_rank)],
                     [(h, heads * model.v_head_dim)]]
    else:
        g = model.query_groups
        qkv = [(heads * d, h), (g * d, h), (g * d, h)] if opt.muon_split_qkv else [((heads + 2 * g) * d, h)]
        attention = [qkv, [(h, heads * d)]]

    def mlp(ffn):
        return [[(ffn, h)] * (2 if model.activation == "swiglu" else 1), [(h, ffn)]]
    return attention, mlp


def muon_balance(cfg: Config, dp: int) -> MuonBalance:
    """Every rank's Newton-Schulz FLOPs per step at data-parallel size ``dp``."""
    model, par, opt = cfg.model, cfg.parallel, cfg.optimizer
    attention, mlp = block_weights(model, opt)
    partition, slots = stage_layers(cfg), [(t, d) for t in range(par.tp) for d in range(dp * par.cp)]
    experts_dp, shares = dp * par.cp // par.ep, par.ep * (par.tp if whole_experts(par) else 1)
    flops = []
    for rank in range(par.pp):
        dense, experts = [], []
        for chunk in range(par.virtual_pp):
            for layer in partition[chunk_stage(par, rank, chunk)]:
                moe = model.is_moe_layer(layer)
                dense += attention + (mlp(model.moe_shared_experts * model.moe_ffn_size)
                                      if moe and model.moe_shared_experts else [] if moe else mlp(model.ffn_size))
                experts += mlp(model.moe_ffn_size) * (model.num_experts // shares) if moe else []
        loads = {slot: 0.0 for slot in slots}
        for weight, owner in zip(dense, assign_owners([_cost(model, opt, w) for w in dense], slots)):
            loads[owner] += _cost(model, opt, weight)
        # each expert-data-parallel group (member e of share s: DP rank e * ep + s) owns its share's experts alike;
        # whole experts are each TP rank's own, owned within its group
        own = [(t, e) for t in range(1 if whole_experts(par) else par.tp) for e in range(experts_dp)]
        for weight, (t, e) in zip(experts, assign_owners([_cost(model, opt, w) for w in experts], own)):
            for share in range(par.ep):
                for tp_rank in (range(par.tp) if whole_experts(par) else [t]):
                    loads[(tp_rank, e * par.ep + share)] += _cost(model, opt, weight)
        flops += [loads[slot] for slot in slots]
    return MuonBalance(flops, sum(flops))


def tp_exchange_bytes(rows: int, cols: int, split: int, tp: int, steps: int, element: int = 2) -> tuple[float, float]:
    """Bytes one TP rank sends per step for a matrix cut in ``tp`` along dimension ``split`` (0: rows), two ways:
    (``gather``: its piece to the owner and the update back, what the optimizer does; ``gram``: Newton-Schulz on the
    pieces, an all-reduce of the Gram matrix per iteration, Megatron's ``newton_schulz_tp``). The Gram is of the
    uncut side, so the pieces' products add up only when the cut side is the longer one; a ring all-reduce of
    n elements sends 2 n (tp - 1) / tp."""
    share = (tp - 1) / tp
    gather = 2 * rows * cols * share * element  # the piece out, the update in: counted at the owner, the busiest
    uncut = cols if split == 0 else rows
    gram = steps * 2 * uncut ** 2 * share * element if (rows, cols)[split] >= uncut else float("inf")
    return gather, gram

