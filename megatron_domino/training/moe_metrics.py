"""Routing metrics of a mixture-of-experts run at a logging step, from every MoE layer on every rank.

Each layer keeps its step's counts on the device (``models.moe.MoEStats``); at a logging step every rank
sums one [layers, 3 * experts + 7] table over the world (layers it does not hold are zero). TP replicas and
DP ranks add to numerator and denominator alike, so the ratios below are those of the global batch.

- ``moe_aux_loss``, ``moe_z_loss``: the raw losses (before their coefficients), mean over MoE layers and
  micro-batches (each over all its tokens, ``models.balance``); a perfectly balanced router has aux loss 1;
  ``moe_seq_aux_loss`` likewise, with the sequence-wise loss on (``model.moe_seq_aux_loss_coeff``);
- ``moe_expert_share``: per MoE layer, each expert's share of the routed assignments (before drops);
  its min and max over layers and experts;
- ``moe_dropped_fraction``: assignments dropped by the capacity factor / all assignments;
- with aux-loss-free balancing (``models.expert_bias``): ``moe_unbiased_share_min`` / ``_max``, the shares the
  router would have given without its bias, and ``moe_expert_bias_min`` / ``_max``, the bias itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.strict import to_host


def moe_metrics(chunks, model_cfg, device) -> dict:
    """A collective: every rank calls it at the same logging steps."""
    experts = model_cfg.num_experts
    # per layer: its stats (``MoEStats``), then the expert bias summed over the ranks holding it, and their count
    layers = model_cfg.num_layers + model_cfg.mtp_num_layers  # MTP's blocks after the main model's
    table = torch.zeros(layers, 3 * experts + 7, dtype=torch.float64, device=device)
    biased = model_cfg.moe_router_bias_update_rate > 0
    for chunk in chunks:
        for layer_id, layer in chunk.moe_layers():
            table[layer_id, :2 * experts + 6] = layer.stats.values
            if biased:
                table[layer_id, 2 * experts + 6:3 * experts + 6] = layer.router.expert_bias.double()
                table[layer_id, -1] = 1
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)
    table = to_host(table)[[i for i in range(layers) if model_cfg.is_moe_layer(i)]]
    counts = table[:, :experts]
    dropped, assigned, aux, z_loss, groups = table[:, experts:experts + 5].unbind(dim=1)
    share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
    record = {"moe_aux_loss": (aux.sum() / groups.sum()).item(), "moe_z_loss": (z_loss.sum() / groups.sum()).item(),
              "moe_expert_share_min": share.min().item(), "moe_expert_share_max": share.max().item(),
              "moe_dropped_fraction": (dropped.sum() / assigned.sum()).item(), "moe_expert_share": share.tolist()}
    if model_cfg.moe_seq_aux_loss_coeff > 0:
        record["moe_seq_aux_loss"] = (table[:, 2 * experts + 5].sum() / groups.sum()).item()
    if biased:
        unbiased = table[:, experts + 5:2 * experts + 5]
        unbiased = unbiased / unbiased.sum(dim=1, keepdim=True).clamp(min=1)
        bias = table[:, 2 * experts + 6:3 * experts + 6] / table[:, -1:].clamp(min=1)
        record.update(moe_unbiased_share_min=unbiased.min().item(), moe_unbiased_share_max=unbiased.max().item(),
                      moe_expert_bias_min=bias.min().item(), moe_expert_bias_max=bias.max().item())
    return record


def format_moe(record: dict) -> str:
    """The compact console part: 'moe aux 1.012 z 3.41 share 0.18-0.33 dropped 2.1%' (and 'seq 1.21' after aux
    with the sequence-wise loss on)."""
    sequence = f" seq {record['moe_seq_aux_loss']:.3f}" if "moe_seq_aux_loss" in record else ""
    return (f"moe aux {record['moe_aux_loss']:.3f}{sequence} z {record['moe_z_loss']:.3g} share "
            f"{record['moe_expert_share_min']:.2f}-{record['moe_expert_share_max']:.2f} "
            f"dropped {100 * record['moe_dropped_fraction']:.1f}%")
