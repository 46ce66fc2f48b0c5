"""MuonClip (Kimi K2): after the update, a head whose largest attention logit S passed the threshold tau this step
has its query and key weights scaled so that S would have been tau.

With eta_h = min(1, tau / S_h) per query head h, Kimi scales a head's W_q and W_k by sqrt(eta_h) each. Under
grouped-query attention a key head serves several query heads, so here the key head g takes sqrt(min eta over its
queries) and each query head eta_h / that: every head's logits shrink by exactly eta_h (the group's least-clipped
heads no less, none more). Values and the output projection are untouched.

The maxima come from the attention layers (``models/logit_max.py``), per TP rank for its own heads; one all-reduce
(max) over the data- and context-parallel ranks makes them the whole step's, for every layer at once. The scale
then multiplies the masters' rows of the fused QKV (group-major, ``ParamInfo.heads``) in each rank's ZeRO
fragments, before the weights are gathered (bf16 masters: rounded to nearest; a compensated master's small
compensation is left as it is).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.comm import group_size


def row_scales(maxima: torch.Tensor, queries: int, dim: int, tau: float) -> torch.Tensor:
    """The factor of every row of a TP-local, group-major QKV whose local heads reached ``maxima``."""
    eta = (tau / maxima).clamp(max=1.0).view(-1, queries)  # [local groups, queries per group]
    key = eta.min(dim=1, keepdim=True).values.sqrt()
    per_head = torch.cat([eta / key, key, torch.ones_like(key)], dim=1)  # queries, key, value
    return per_head.repeat_interleave(dim, dim=1).reshape(-1)


class QKClip:
    """The clip of an optimizer's fragments. ``trackers``: (QKV weight, heads layout, running maxima) per layer."""

    def __init__(self, trackers: list, fragments: list, tau: float, group):
        self.trackers, self.tau, self.group = trackers, tau, group
        self.of = {id(weight): [i for i, f in enumerate(fragments) if f.param is weight] for weight, _, _ in trackers}
        self.maxima = None  # the last step's reduced maxima, every layer's heads in order (a device tensor)

    def reset(self) -> None:
        for _, _, maxima in self.trackers:
            maxima.fill_(float("-inf"))

    @torch.no_grad()
    def apply(self, masters: list[torch.Tensor], fragments: list) -> list[int]:
        """Scale the masters' QKV rows; returns the fragments changed (their weights need the masters again)."""
        maxima = torch.cat([m for _, _, m in self.trackers])
        if group_size(self.group) > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.group)
        self.maxima = maxima
        changed, at = [], 0
        for weight, (_, queries, dim), local in self.trackers:
            scales = row_scales(maxima[at:at + local.numel()], queries, dim, self.tau)
            at += local.numel()
            per_element = scales.repeat_interleave(weight.shape[1])
            for i in self.of[id(weight)]:
                f = fragments[i]
                masters[i].mul_(per_element[f.start:f.end].to(masters[i].dtype))
                changed.append(i)
        self.reset()
        return changed
