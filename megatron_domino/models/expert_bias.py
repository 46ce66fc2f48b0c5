"""Aux-loss-free load balancing (DeepSeek-V3): a per-expert bias, added to the router's scores when experts are
chosen and never to the gates, moved after every optimizer step toward the experts that got too few tokens.

The bias is a parameter without a gradient (``router.expert_bias``): it is replicated like the router, saved
and loaded under its layout-free name with the weights, and untouched by the optimizer. The update is
bias_i += rate * sign(mean_j load_j - load_i), the load being the step's assignments to expert i counted by
every rank that routes its own tokens through the layer: the data-parallel and context-parallel ranks (one
all-reduce of [layers, E] per step; tensor-parallel ranks route the same tokens and so agree already). Every
rank then applies the same update.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import comm


@torch.no_grad()
def update_expert_biases(chunks, group) -> None:
    """After a step that changed the weights: move every biased MoE layer's bias (``group``: dp x cp)."""
    layers = [layer for chunk in chunks for _, layer in chunk.moe_layers() if layer.bias_update_rate > 0]
    if not layers:
        return
    loads = torch.stack([layer.stats.values[:layer.num_experts] for layer in layers])
    if comm.group_size(group) > 1:
        dist.all_reduce(loads, group=group)
    for layer, load in zip(layers, loads):
        bias = layer.router.expert_bias
        bias.add_(torch.sign(load.mean() - load).to(bias.dtype), alpha=layer.bias_update_rate)
