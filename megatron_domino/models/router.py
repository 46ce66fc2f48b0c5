"""Token routing for the mixture-of-experts layer: top-k choice, gates, capacity drops, auxiliary losses.

Everything here is plain fp32 tensor math on the router's logits [T, E] (T tokens of one routing group,
E experts); it knows nothing of tensor parallelism. Rules:

- ``softmax`` (Mixtral): p = softmax(logits); the top-k experts by p; gates = their p renormalised to sum 1
  (``normalize``; Qwen3-MoE's norm_topk_prob false keeps them as they are).
- ``sigmoid`` (DeepSeek-V3): s = sigmoid(logits); the top-k experts by s; gates = their s normalised to sum 1.
  The balance loss reads p = s / sum_e s (each token's scores normalised over all experts).
- Capacity (``capacity_factor`` set): each expert takes at most C = ceil(T * k * factor / E) assignments.
  An expert's assignments are queued in token order (token 0 first; a token never picks one expert twice),
  and those at queue position >= C are dropped: they contribute nothing, the token keeps its residual.
- Load-balancing loss (Switch Transformer, Mixtral): E * sum_i f_i * P_i, f_i = (assignments routed to i,
  before drops) / (T * k), P_i = mean over tokens of p_i. It is 1 when routing is uniform.
- Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2.
Both are defined over a token set that may span several routing groups (``balance``: a micro-batch routed in
Domino mu-chunks and over CP ranks), so a group reports sums: its counts, sum_t p_t and sum_t lse_t^2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Routing:
    gates: torch.Tensor  # [T, k] fp32, differentiable
    experts: torch.Tensor  # [T, k] expert of each assignment
    kept: torch.Tensor  # [T, k] bool: False where the capacity dropped the assignment
    counts: torch.Tensor  # [E] assignments routed to each expert, before drops (fp32, no gradient)
    prob_sums: torch.Tensor  # [E] sum over the group's tokens of p, differentiable
    z_sum: torch.Tensor  # scalar: sum over the group's tokens of logsumexp(logits)^2, differentiable

    @property
    def tokens(self) -> int:
        return self.experts.shape[0]

    @property
    def aux_loss(self) -> torch.Tensor:
        """The balance loss of this group's tokens alone."""
        return balance_loss(self.counts, self.prob_sums, self.tokens, self.experts.shape[1])

    @property
    def z_loss(self) -> torch.Tensor:
        """The z-loss of this group's tokens alone."""
        return self.z_sum / self.tokens


def balance_loss(counts: torch.Tensor, prob_sums: torch.Tensor, tokens: int, topk: int) -> torch.Tensor:
    """E * sum_i f_i * P_i from the sums over ``tokens`` tokens (see the module docstring)."""
    return counts.numel() * (counts / (tokens * topk) * prob_sums / tokens).sum()


def route(logits: torch.Tensor, topk: int, router: str, capacity_factor: float | None,
          normalize: bool = True) -> Routing:
    """Route T tokens given their logits [T, E] (fp32)."""
    tokens, num_experts = logits.shape
    if router == "softmax":
        probs = torch.softmax(logits, dim=-1)
        top, experts = probs.topk(topk, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        top, experts = scores.topk(topk, dim=-1)
        probs = scores / scores.sum(dim=-1, keepdim=True)
    gates = top / top.sum(dim=-1, keepdim=True) if normalize else top
    counts = F.one_hot(experts, num_experts).sum(dim=(0, 1)).to(logits.dtype)
    kept = (torch.ones_like(experts, dtype=torch.bool) if capacity_factor is None
            else within_capacity(experts, num_experts, math.ceil(tokens * topk * capacity_factor / num_experts)))
    return Routing(gates, experts, kept, counts, probs.sum(dim=0), torch.logsumexp(logits, dim=-1).square().sum())


def within_capacity(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[T, k] bool: the assignment's position in its expert's token-ordered queue is below ``capacity``."""
    per_token = F.one_hot(experts, num_experts).sum(dim=1)  # [T, E], 0 or 1
    queue_position = per_token.cumsum(dim=0) - per_token  # assignments to e by earlier tokens
    return queue_position.gather(1, experts) < capacity
