"""Token routing for the mixture-of-experts layer: top-k choice, gates, capacity drops, auxiliary losses.

Everything here is plain fp32 tensor math on the router's logits [T, E] (T tokens of one routing group,
E experts); it knows nothing of tensor parallelism. Rules:

- ``softmax`` (Mixtral): p = softmax(logits); the top-k experts by p; gates = their p renormalised to sum 1
  (``normalize``; Qwen3-MoE's norm_topk_prob false keeps them as they are).
- ``sigmoid`` (DeepSeek-V3): s = sigmoid(logits); the top-k experts by s; gates = their s normalised to sum 1.
  The balance loss reads p = s / sum_e s (each token's scores normalised over all experts).
- DeepSeek-V3's selection (``Selection``): a per-expert ``bias`` added to the scores for choosing only (aux-loss-
  free balancing; the gates use the scores themselves), group-limited routing (experts in ``groups`` groups of
  which a token may use the ``topk_group`` whose two best scores sum highest), gates times ``scale``.
- Capacity (``capacity_factor`` set): each expert takes at most C = ceil(T * k * factor / E) assignments.
  An expert's assignments are queued, and those at queue position >= C are dropped: they contribute nothing,
  the token keeps its residual. The queue (``drop_policy``) is in token order (``position``: token 0 first; a
  token never picks one expert twice), by descending gate (``probs``, Megatron's), or in a random order
  (``random``, DeepSpeed's random token selection) drawn from the default stream, which every TP rank routing
  the same tokens draws alike (``parallel.random``) and recompute replays.
- Load-balancing loss (Switch Transformer, Mixtral): E * sum_i f_i * P_i, f_i = (assignments routed to i,
  before drops) / (T * k), P_i = mean over tokens of p_i. It is 1 when routing is uniform.
- Sequence-wise balance loss (DeepSeek-V3): the same E * sum_i f_i * P_i within each sequence, averaged over the
  sequences (``balance``; it needs each token's p, ``Routing.probs``).
- Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2.
Both are defined over a token set that may span several routing groups (``balance``: a micro-batch routed in
Domino mu-chunks and over CP ranks), so a group reports sums: its counts, sum_t p_t and sum_t lse_t^2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

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
    unbiased_counts: torch.Tensor | None = None  # [E] what the counts would be without the bias (metrics)
    probs: torch.Tensor | None = None  # [T, E] each token's p, differentiable (the sequence-wise balance loss)

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


@dataclass(frozen=True)
class Selection:
    """How experts are chosen and gated beyond top-k (see the module docstring); the defaults change nothing."""

    normalize: bool = True  # gates renormalised to sum 1 over the chosen (norm_topk_prob)
    scale: float = 1.0  # gates times this (DeepSeek-V3's routed_scaling_factor)
    groups: int | None = None  # group-limited routing: experts in this many groups...
    topk_group: int | None = None  # ... of which a token may use this many
    bias: torch.Tensor | None = field(default=None, compare=False)  # [E] added to the scores for choosing only


def _choose(scores: torch.Tensor, topk: int, selection: Selection, bias: torch.Tensor | None) -> torch.Tensor:
    """[T, k] experts: the top-k of the (biased) scores, within each token's best ``topk_group`` groups."""
    ranked = scores if bias is None else scores + bias
    if selection.groups is not None:
        tokens, num_experts = ranked.shape
        grouped = ranked.view(tokens, selection.groups, num_experts // selection.groups)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        best = group_scores.topk(selection.topk_group, dim=-1).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        ranked = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(tokens, num_experts)
    return ranked.topk(topk, dim=-1).indices


def route(logits: torch.Tensor, topk: int, router: str, capacity_factor: float | None,
          selection: Selection = Selection(), drop_policy: str = "position") -> Routing:
    """Route T tokens given their logits [T, E] (fp32)."""
    tokens, num_experts = logits.shape
    if router == "softmax":
        scores = probs = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(dim=-1, keepdim=True)
    experts = _choose(scores.detach(), topk, selection, selection.bias)
    top = scores.gather(1, experts)
    gates = (top / top.sum(dim=-1, keepdim=True) if selection.normalize else top) * selection.scale
    counts = F.one_hot(experts, num_experts).sum(dim=(0, 1)).to(logits.dtype)
    unbiased = None
    if selection.bias is not None:
        unbiased = F.one_hot(_choose(scores.detach(), topk, selection, None), num_experts).sum(dim=(0, 1))
    kept = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor is not None:
        priority = {"position": None, "probs": top.detach(), "random": torch.rand_like(top)}[drop_policy]
        kept = within_capacity(experts, num_experts, math.ceil(tokens * topk * capacity_factor / num_experts),
                               priority)
    return Routing(gates, experts, kept, counts, probs.sum(dim=0), torch.logsumexp(logits, dim=-1).square().sum(),
                   None if unbiased is None else unbiased.to(logits.dtype), probs)


def within_capacity(experts: torch.Tensor, num_experts: int, capacity: int,
                    priority: torch.Tensor | None = None) -> torch.Tensor:
    """[T, k] bool: the assignment's position in its expert's queue is below ``capacity``; the queue is in token
    order, or by descending ``priority`` [T, k] when given (ties in token order)."""
    if priority is None:
        per_token = F.one_hot(experts, num_experts).sum(dim=1)  # [T, E], 0 or 1
        queue_position = per_token.cumsum(dim=0) - per_token  # assignments to e by earlier tokens
        return queue_position.gather(1, experts) < capacity
    flat = experts.flatten()
    order = priority.flatten().argsort(descending=True, stable=True)
    order = order[flat[order].argsort(stable=True)]  # grouped by expert, each group by descending priority
    # assignments per expert by a scatter-add: CUDA's bincount reads its output size on the host
    counts = flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))
    queue_position = torch.empty_like(flat)
    queue_position[order] = torch.arange(len(flat), device=flat.device) - (counts.cumsum(0) - counts)[flat[order]]
    return (queue_position < capacity).view_as(experts)
