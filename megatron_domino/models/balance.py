"""The token set an MoE layer's auxiliary losses are defined over, whatever the layout: the micro-batch.

A micro-batch may be routed in pieces: Domino's row split routes each mu-chunk on its own, and context
parallelism gives each CP rank a part of every sequence. The balance loss E * sum_i f_i * P_i is not a sum
over pieces (it multiplies two means), so each layer and micro-batch keeps a ``BalanceSet``: every piece adds
its assignment counts as it runs; once the rank's last piece has, the counts are summed over the CP ring by one
asynchronous all-reduce of E numbers, which backward waits for. A piece's gradient is then its exact share of
the set's losses: with f_i over the whole set (a constant, as counts are), d/dp_t of E * sum_i f_i * P_i is
E * f_i / T for every token t of the set, and the z-loss's is that of its mean over the T tokens. Tensor-parallel
ranks route the same tokens (their logits are identical), so each adds 1/tp of the gradient. No host sync: T is
known on the host (every CP rank holds as many tokens), the counts stay on the device.

The layer's contribution to the objective is ``weight`` per sample of the micro-batch (``TokenContext``: the
engine's loss scale over micro-batches x DP ranks x samples) times (aux_coeff * balance + z_coeff * z-loss).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import comm


class BalanceSet:
    """One MoE layer's routing pieces of one micro-batch on this rank, and the CP ranks holding the rest."""

    def __init__(self, pieces: int, cp_group, topk: int):
        self.pieces, self.cp_group, self.topk = pieces, cp_group, topk
        self.counts: list[torch.Tensor] = []
        self.tokens = self.samples = 0
        self.total: torch.Tensor | None = None  # [E] counts over the set, once every local piece has run
        self._work = None

    def add(self, counts: torch.Tensor, tokens: int, samples: int) -> None:
        """A piece has routed ``tokens`` tokens of ``samples`` samples; after the last, sum over the CP ring."""
        self.counts.append(counts)
        self.tokens += tokens
        self.samples += samples
        if len(self.counts) == self.pieces:
            self.total = torch.stack(self.counts).sum(dim=0)
            if comm.group_size(self.cp_group) > 1:
                self._work = dist.all_reduce(self.total, group=self.cp_group, async_op=True)

    def fractions(self) -> tuple[torch.Tensor, int]:
        """(f_i = counts_i / (T * k) over the whole set, T): what backward needs."""
        if self.total is None:
            raise RuntimeError(f"an MoE layer's backward ran after {len(self.counts)} of its {self.pieces} routing "
                               f"pieces: the auxiliary losses need every piece of the micro-batch first")
        if self._work is not None:
            self._work.wait()
            self._work = None
        tokens = self.tokens * comm.group_size(self.cp_group)
        return self.total / (tokens * self.topk), tokens


class AttachLosses(torch.autograd.Function):
    """Identity on the gates (an output that is not a view, so the in-place all-reduce may modify it); backward
    also seeds this piece's share of the set's auxiliary losses: ``prob_sums`` and ``z_sum`` of its tokens
    (``router.Routing``). ``coeffs``: (aux, z) coefficients times the objective's weight per sample / tp;
    ``record(aux, z, T)``, when given, receives this piece's share of the losses' values and the set's token
    count (for metrics)."""

    @staticmethod
    def forward(ctx, gates, prob_sums, z_sum, balance: BalanceSet, coeffs: tuple[float, float], record):
        ctx.balance, ctx.coeffs, ctx.record = balance, coeffs, record
        ctx.save_for_backward(prob_sums.detach(), z_sum.detach())
        return gates.view_as(gates)

    @staticmethod
    def backward(ctx, grad):
        prob_sums, z_sum = ctx.saved_tensors
        fractions, tokens = ctx.balance.fractions()
        aux_coeff, z_coeff = ctx.coeffs
        samples = ctx.balance.samples
        experts = fractions.numel()
        if ctx.record is not None:
            ctx.record(experts * (fractions * prob_sums).sum() / tokens, z_sum / tokens, tokens)
        grad_probs = fractions * (aux_coeff * samples * experts / tokens)
        grad_z = torch.full_like(z_sum, z_coeff * samples / tokens)
        return grad, grad_probs, grad_z, None, None, None
