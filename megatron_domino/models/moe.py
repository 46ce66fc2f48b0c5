"""The mixture-of-experts feed-forward layer (Mixtral, DeepSeek-style), in place of the MLP of an MoE block.

It has the MLP's two phase pieces, so the block, Domino and the pipeline run it unchanged:

- ``hidden`` (recomputable; no TP communication, under EP the token dispatch, which a recompute repeats on
  every member alike): the router, then each expert's fc1 and activation on the tokens routed to it (and the
  shared experts' on every token);
- ``project`` / ``launch``: each expert's fc2 *partial* output (fc2 is row-parallel), scattered back to
  its tokens weighted by the gates and summed, plus the shared experts' partial; then ONE all-reduce
  (reduce-scatter under sequence parallelism) for the whole layer, synchronous or left in flight.
  Weighting partials is exact because the all-reduce is a sum.

Experts are MLPs split over TP like the dense one (expert TP = tp; parameters ``mlp.experts.E.fc1/fc2``,
E the global index). Under expert parallelism (``parallel.ep``) a rank holds num_experts / ep of them and
the token rows travel to their experts and back by all-to-all (``expert_dispatch``); the rank's TP peers
exchange the same rows with their own peers, so each TP rank's partials stay in its TP slice. With expert TP
1 (``parallel.expert_tp``, ``ctx.experts_split`` False) experts stay whole and ``ctx.ep_group`` spans tp x ep
ranks: each TP rank routes only its slice of the tokens, so its partial is its tokens' whole output (zero
elsewhere) and the same one all-reduce completes the layer; no expert gradient is summed over TP. Rows are
sorted by expert in one sort; their sizes are read on the host (one sync per layer and forward, also
under EP, where the counts from the peers come with them). The input enters the TP region once for all
experts (copy, or the SP all-gather) without Domino's asynchronous input-gradient reduction, which serves one
linear.

TP and the router: the router weight is replicated and its fp32 logits enter the TP region like an
activation (backward sums the logits' gradient over TP), so the logits are identical on every TP rank.
The gates multiply partials, so each rank's gate gradient is a partial that the sum completes; the
auxiliary losses are computed identically on every rank, so each adds 1/tp of their gradient. An
expert's fc2 bias is weighted by its gate per token, so a split expert adds it to the partials divided by
tp and its gradient sums over TP. Under SP the router reads this rank's slice (its gradient sums over TP).

Auxiliary losses reach the gradient without a change to the pipeline (as Megatron does):
``balance.AttachLosses`` is the identity on the gates and in backward seeds the losses' gradient. They are
defined over the micro-batch, whichever layout routes it in pieces (Domino's mu-chunks, CP ranks:
``balance``). Their weight in the objective comes by one path, once per training step: the objective
(``loss.Objective``) calls ``begin_step`` with loss_scale / (num_microbatches * dp * micro_batch) per sample,
so the objective is the LM loss (token mean over the global batch) plus the auxiliary losses averaged over
micro-batches and data-parallel ranks. ``begin_step`` also starts the step's routing statistics and (global
scope) its balance sets afresh, which number the micro-batches in the order they reach the layer: their order
in the step, since every schedule runs a chunk's forwards in micro-batch order. Outside a step (a model called
directly) the weight is 1 and each micro-batch's losses stand alone. The capacity, unlike the losses, is per
routing piece (a mu-chunk or a CP rank's tokens route with their own capacity).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..fp8.linear import linear
from ..fp8.scaling import GRAD, INPUT, WEIGHT
from ..parallel import comm
from ..tensor_parallel import ParamInfo, LayerContext, declare, make_param
from ..tensor_parallel.layers import fp8_scaling
from ..tensor_parallel.async_comm import launch_reduce
from .expert_dispatch import ExpertExchange
from .balance import AttachLosses, BalanceSet
from .expert_linear import experts_linear, grouped_mm
from .mlp import MLP
from .router import Routing, Selection, route
from .tokens import NO_CONTEXT, TokenContext


@dataclass
class Routed:
    """What ``hidden`` hands to the projection: the routing and each expert's activations."""

    shape: torch.Size  # [b, s, h] of the full-sequence output
    routing: Routing
    assignments: torch.Tensor  # the kept assignments sorted by expert (token order within one), indices into [T, k]
    tokens: torch.Tensor  # the token of each of those assignments
    exchange: ExpertExchange  # where those rows go and how they come back
    hidden: torch.Tensor  # fc1 + activation of the rows the local experts received, grouped by expert [n, ffn / tp]
    shared: torch.Tensor | None  # the shared experts' activations [b, s, shared ffn / tp]
    balance: BalanceSet  # the micro-batch's routing pieces of this layer


class MoEStats:
    """Routing statistics of one layer over a training step, kept on the device (read when logging)."""

    def __init__(self, num_experts: int, device):
        self.values = torch.zeros(2 * num_experts + 6, dtype=torch.float64, device=device)

    def reset(self) -> None:
        self.values.zero_()

    def add(self, routing: Routing) -> None:
        """[counts per expert..., dropped, assigned, aux loss, z-loss, micro-batches, counts without the expert
        bias..., sequence-wise loss]: the loads of a piece."""
        experts, assigned = routing.counts.numel(), routing.experts.numel()
        kept = routing.kept.sum().to(self.values.dtype)
        self.values[:experts] += routing.counts
        self.values[experts:experts + 2] += torch.stack([assigned - kept, torch.full_like(kept, assigned)])
        unbiased = routing.unbiased_counts if routing.unbiased_counts is not None else routing.counts
        self.values[experts + 5:2 * experts + 5] += unbiased

    def add_losses(self, tokens: int, aux: torch.Tensor, z_loss: torch.Tensor, total_tokens: int,
                   sequence: torch.Tensor | None = None) -> None:
        """A piece's share of its micro-batch's losses, and its share (tokens / the set's) of the micro-batch."""
        experts = (self.values.numel() - 6) // 2
        self.values[experts + 2:experts + 5] += torch.stack([aux.double(), z_loss.double(),
                                                  torch.full_like(aux, tokens / total_tokens, dtype=torch.float64)])
        if sequence is not None:
            self.values[-1] += sequence.double()


class MoE(nn.Module):
    def __init__(self, cfg, ctx: LayerContext):
        super().__init__()
        self.ctx, self.num_experts, self.topk = ctx, cfg.num_experts, cfg.moe_topk
        self.router_kind, self.capacity_factor = cfg.moe_router, cfg.moe_capacity_factor
        self.drop_policy = cfg.moe_token_drop_policy
        self.selection = Selection(cfg.moe_norm_topk_prob, cfg.moe_routed_scaling_factor, cfg.moe_n_group,
                                   cfg.moe_topk_group)
        self.bias_update_rate = cfg.moe_router_bias_update_rate
        self.aux_coeff, self.z_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
        self.seq_coeff = cfg.moe_seq_aux_loss_coeff
        self.global_scope = cfg.moe_aux_loss_scope == "global"
        self.aux_loss_weight = 1.0  # the step's weight of the auxiliary losses per sample (``begin_step``)
        self.step_sets: dict[int, BalanceSet] | None = None  # global scope: this step's sets by micro-batch index
        self.router = nn.Module()
        declare(self.router, "weight", make_param((cfg.num_experts, cfg.hidden_size), ctx),
                ParamInfo(None, "normal", cfg.init_std, grad_sums_over_tp=ctx.sequence_parallel))
        if self.bias_update_rate > 0:  # aux-loss-free balancing (``expert_bias``): no gradient, kept in checkpoints
            declare(self.router, "expert_bias", make_param((cfg.num_experts,), ctx).requires_grad_(False),
                    ParamInfo(None, "zeros"))
        ep, ep_rank = comm.group_size(ctx.ep_group), comm.group_rank(ctx.ep_group)
        local = cfg.num_experts // ep
        self.split = ctx.experts_split or ctx.size == 1
        whole = replace(ctx, group=None, sequence_parallel=False, grad_pieces=0)  # experts of expert TP 1
        self.experts = nn.ModuleDict({str(e): MLP(cfg, ctx if self.split else whole, cfg.moe_ffn_size)
                                      for e in range(ep_rank * local, (ep_rank + 1) * local)})
        for expert in self.experts.values():
            for layer in (expert.fc1, expert.fc2):
                for name, info in layer.param_info.items():
                    # a split fc2 bias is gate-weighted per token: added as partials, its gradient sums over TP
                    sums_over_tp = self.split and (info.grad_sums_over_tp or (layer is expert.fc2 and name == "bias"))
                    declare(layer, name, getattr(layer, name),
                            replace(info, expert=True, grad_sums_over_tp=sums_over_tp,
                                    spec=info.spec if self.split else None, tp_replicated=self.split))
        if ctx.fp8 is not None:  # one scaling per projection for all the layer's experts (fp8/state.py)
            experts_ctx = ctx if self.split else whole
            fc1, fc2 = fp8_scaling(experts_ctx, (WEIGHT, GRAD)), fp8_scaling(experts_ctx, (WEIGHT, INPUT))
            for expert in self.experts.values():
                expert.fc1.fp8, expert.fc2.fp8 = fc1, fc2
        self.grouped_gemm = cfg.moe_grouped_gemm
        if self.grouped_gemm and grouped_mm is None:
            raise ValueError(f"model.moe_grouped_gemm = true: torch {torch.__version__} has no grouped_mm. Fix: use "
                             f"torch >= 2.9, or set model.moe_grouped_gemm=false (a loop over the experts)")
        self.shared_experts = (MLP(cfg, ctx, cfg.moe_shared_experts * cfg.moe_ffn_size)
                               if cfg.moe_shared_experts else None)
        self.stats = MoEStats(cfg.num_experts, ctx.device)

    def begin_step(self, aux_loss_weight: float) -> None:
        """A training step begins: weigh the auxiliary losses by ``aux_loss_weight`` per sample, count the routing
        afresh and (global scope) number the micro-batches from 0."""
        self.aux_loss_weight, self.step_sets = aux_loss_weight, {}
        self.stats.reset()

    def hidden(self, x: torch.Tensor, context: TokenContext = NO_CONTEXT) -> Routed:
        """Route this rank's [b, s(/tp under SP), h] tokens and run every expert's first half on its tokens."""
        group = self.ctx.group
        enter = comm.gather_from_sp if self.ctx.sequence_parallel else comm.copy_to_tp
        logits = enter(F.linear(x.float(), self.router.weight.float()), group)
        tokens = enter(x, group)
        shape = tokens.shape
        tokens, logits = tokens.flatten(0, 1), logits.flatten(0, 1)
        selection = self.selection
        if self.bias_update_rate > 0:
            selection = replace(selection, bias=self.router.expert_bias.float())
        routing = route(logits, self.topk, self.router_kind, self.capacity_factor, selection, self.drop_policy)
        # one stable sort by expert puts every expert's kept assignments together, in token order
        kept = routing.kept if self.split else routing.kept & self._my_tokens(len(tokens))
        key = torch.where(kept, routing.experts, self.num_experts).flatten()
        order = key.argsort(stable=True)
        # rows per expert by a scatter-add: CUDA's bincount would read its output size on the host
        counts = key.new_zeros(self.num_experts + 1).scatter_add_(0, key, torch.ones_like(key))
        exchange = ExpertExchange(counts[:self.num_experts], self.ctx.ep_group, self.ctx.turns)
        assignments = order[:sum(exchange.sizes)]
        token_ids = assignments // self.topk
        fc1 = experts_linear(exchange.dispatch(tokens[token_ids]), exchange.local_sizes,
                             [expert.fc1 for expert in self.experts.values()], self.grouped_gemm)
        hidden = next(iter(self.experts.values())).activate(fc1)
        shared = self.shared_experts.hidden(x) if self.shared_experts is not None else None
        return Routed(shape, routing, assignments, token_ids, exchange, hidden, shared, self._balance_set(context))

    def _balance_set(self, context: TokenContext) -> BalanceSet:
        """The set of tokens this call's losses are defined over (``balance``)."""
        if context.balance is None:  # no micro-batch around this call: its tokens are the whole set
            return BalanceSet(1, self.ctx.cp_group, self.topk)
        if id(self) not in context.balance:  # else a recomputed forward: the set its first forward made
            if self.global_scope and self.step_sets is not None and torch.is_grad_enabled():
                index = len(self.step_sets)  # the step's next micro-batch
                balance = BalanceSet(context.pieces, self.ctx.cp_group, self.topk, self.ctx.balance_group,
                                     self.step_sets, index)
                self.step_sets[index] = balance
            else:
                balance = BalanceSet(context.pieces, self.ctx.cp_group, self.topk)
            context.balance[id(self)] = balance
        return context.balance[id(self)]

    def _my_tokens(self, count: int) -> torch.Tensor:
        """[T, 1] bool: with whole experts, the slice of the tokens this TP rank routes."""
        size, rank = self.ctx.size, self.ctx.rank
        mine = torch.zeros(count, 1, dtype=torch.bool, device=self.router.weight.device)
        mine[count * rank // size:count * (rank + 1) // size] = True
        return mine

    def _partial(self, routed: Routed) -> torch.Tensor:
        """This rank's share of the layer output before the TP sum, [b, s, h], with the auxiliary losses attached."""
        b, s, h = routed.shape
        tp = comm.group_size(self.ctx.group)
        routing, gates = routed.routing, routed.routing.gates
        if torch.is_grad_enabled():  # training: evaluation neither counts nor differentiates
            self.stats.add(routing)
            sequence_counts = sequence_probs = None
            if self.seq_coeff:  # per sample: the sequence-wise balance loss
                one_hot = F.one_hot(routing.experts, self.num_experts).sum(dim=1).to(routing.counts.dtype)
                sequence_counts = one_hot.view(b, -1, self.num_experts).sum(dim=1)
                sequence_probs = routing.probs.view(b, -1, self.num_experts).sum(dim=1)
            first = routed.balance.add(routing.counts, routing.tokens, b, sequence_counts)
            weight = self.aux_loss_weight / tp
            record = functools.partial(self.stats.add_losses, routing.tokens)
            coeffs = (self.aux_coeff * weight, self.z_coeff * weight, self.seq_coeff * weight)
            gates = AttachLosses.apply(gates, routing.prob_sums, routing.z_sum, sequence_probs, routed.balance, first,
                                       coeffs, record)
        outputs = experts_linear(routed.hidden, routed.exchange.local_sizes,
                                 [expert.fc2 for expert in self.experts.values()], self.grouped_gemm,
                                 tp if self.split else 1)
        rows = routed.exchange.combine(outputs)
        weighted = rows * gates.flatten()[routed.assignments].unsqueeze(-1).to(rows.dtype)
        out = rows.new_zeros(b * s, h).index_add(0, routed.tokens, weighted).view(b, s, h)
        if routed.shared is not None:
            out = out + linear(routed.shared, self.shared_experts.fc2.weight, None, self.shared_experts.fc2.fp8)
        return out

    def _bias(self):
        return self.shared_experts.fc2.bias if self.shared_experts is not None else None

    def project(self, routed: Routed):
        """The experts' fc2, combined, with the synchronous all-reduce (reduce-scatter under SP): (output, bias)."""
        partial = self._partial(routed)
        if self.ctx.sequence_parallel:
            return comm.reduce_scatter_to_sp(partial, self.ctx.group), self._bias()
        return comm.reduce_from_tp(partial, self.ctx.group), self._bias()

    def launch(self, routed: Routed, pieces: int = 1):
        """Domino: the same, its all-reduce left in flight in ``pieces`` column pieces."""
        partial = self._partial(routed)
        parts = partial.tensor_split(pieces, dim=-1) if pieces > 1 else [partial]
        return launch_reduce(parts, self.ctx.group, count=len(parts),
                             sequence_parallel=self.ctx.sequence_parallel), self._bias()
