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

DeepSeek-V3's sequence-wise balance loss is the same loss within each sequence (a sample row), averaged over the
micro-batch's sequences: the set also sums each sequence's counts [samples, E] over the CP ring (in the same one
all-reduce), and a piece's tokens get E * f_(b,i) / T_seq for their sequence b. Domino's mu-chunks hold whole
sequences, so a piece's samples are a run of the set's (``add`` returns where it starts).

With ``model.moe_aux_loss_scope: global`` (Megatron's global_aux_loss) the balance loss's f_i is over more
tokens: those of micro-batch j of every data-parallel rank (the DP-wide micro-batch: the counts are summed over
dp x cp, ``count_group``), averaged with the step's earlier micro-batches 0..j (``earlier``: the layer's sets of
this step, numbered as they reach the layer: ``MoE.begin_step``), P_i staying this rank's. Each DP rank then adds
the gradient of its own tokens' P_i, and the sum over DP is that of E * sum_i f_i * P_i over the DP-wide
micro-batch: the same for every TP, CP, Domino and pipeline layout, and at dp d equal to one process whose
micro-batch j is the d ranks' j-th ones together. Only f_i changes: the z-loss is a mean (layout-free in any
scope) and the sequence-wise loss stays per sequence.

The layer's contribution to the objective is ``weight`` per sample of the micro-batch (``MoE.begin_step``: the
objective's loss scale over micro-batches x DP ranks x samples) times (aux_coeff * balance + z_coeff * z-loss +
seq_coeff * sequence-wise balance).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import comm


class BalanceSet:
    """One MoE layer's routing pieces of one micro-batch on this rank, and the CP ranks holding the rest.

    The global scope is on when ``earlier`` is given (the layer's sets of this step, micro-batch index -> set:
    0..``index`` once this one is made): the counts are summed over ``count_group`` (dp x cp) and averaged with
    the step's earlier micro-batches up to ``index``."""

    def __init__(self, pieces: int, cp_group, topk: int, count_group=None, earlier: dict | None = None,
                 index: int = 0):
        self.pieces, self.cp_group, self.topk = pieces, cp_group, topk
        self.count_group, self.earlier, self.index = count_group, earlier, index
        self.counts: list[torch.Tensor] = []
        self.sample_counts: list[torch.Tensor] = []  # [samples, E] per piece, for the sequence-wise loss
        self.tokens = self.samples = 0
        self.total: torch.Tensor | None = None  # [E] counts over the set, once every local piece has run
        self.sequence_total: torch.Tensor | None = None  # [samples, E] per sequence, over the CP ring
        self.running: torch.Tensor | None = None  # global scope: ``total`` summed over micro-batches 0..index
        self._works = []

    def add(self, counts: torch.Tensor, tokens: int, samples: int, sample_counts: torch.Tensor | None = None) -> int:
        """A piece has routed ``tokens`` tokens of ``samples`` samples (``sample_counts``: per sample, when the
        sequence-wise loss is on); after the last, sum over the ranks sharing the set (asynchronously, one
        all-reduce per group). Returns the piece's first sample."""
        first = self.samples
        self.counts.append(counts)
        if sample_counts is not None:
            self.sample_counts.append(sample_counts)
        self.tokens += tokens
        self.samples += samples
        if len(self.counts) == self.pieces:
            total = torch.stack(self.counts).sum(dim=0)
            sequences = torch.cat(self.sample_counts) if self.sample_counts else None
            if self.earlier is None and sequences is not None:  # one all-reduce over the ring for both
                total = torch.cat([total, sequences.flatten()])
                self.total, self.sequence_total = total[:self.experts], total[self.experts:].view_as(sequences)
                self._reduce(total, self.cp_group)
            else:
                self.total, self.sequence_total = total, sequences
                self._reduce(total, self.cp_group if self.earlier is None else self.count_group)
                if sequences is not None:
                    self._reduce(sequences, self.cp_group)
        return first

    @property
    def experts(self) -> int:
        return self.counts[0].numel()

    def _reduce(self, tensor: torch.Tensor, group) -> None:
        if comm.group_size(group) > 1:
            self._works.append(dist.all_reduce(tensor, group=group, async_op=True))

    def _settled(self) -> "BalanceSet":
        if self.total is None:
            raise RuntimeError(f"an MoE layer's backward ran after {len(self.counts)} of its {self.pieces} routing "
                               f"pieces: the auxiliary losses need every piece of the micro-batch first")
        for work in self._works:
            work.wait()
        self._works = []
        return self

    def fractions(self) -> tuple[torch.Tensor, int]:
        """(f_i = counts_i / (T * k) over the whole set, T the micro-batch's tokens): what backward needs. In
        the global scope, f_i over the DP-wide micro-batches 0..index, averaged."""
        tokens = self.tokens * comm.group_size(self.cp_group)
        if self.earlier is None:
            return self._settled().total / (tokens * self.topk), tokens
        every_rank = self.tokens * comm.group_size(self.count_group) * (self.index + 1)
        return self._running() / (every_rank * self.topk), tokens

    def _running(self) -> torch.Tensor:
        """The counts of micro-batches 0..index summed: each set keeps its running sum, made from the one before
        it once (one add per micro-batch and layer, however many pieces and micro-batches ask)."""
        first = self.index
        while first > 0 and self.earlier[first - 1].running is None:
            first -= 1
        for i in range(first, self.index + 1):
            here = self.earlier[i]
            if here.running is None:
                here.running = here._settled().total + (self.earlier[i - 1].running if i else 0)
        return self.running

    def sequence_fractions(self) -> tuple[torch.Tensor, int]:
        """([samples, E] f_(b,i) = counts_(b,i) / (T_seq * k) of each sequence, T_seq), after ``fractions``."""
        per_sequence = self.tokens * comm.group_size(self.cp_group) // self.samples
        return self._settled().sequence_total / (per_sequence * self.topk), per_sequence


class AttachLosses(torch.autograd.Function):
    """Identity on the gates (an output that is not a view, so the in-place all-reduce may modify it); backward
    also seeds this piece's share of the set's auxiliary losses: ``prob_sums`` and ``z_sum`` of its tokens
    (``router.Routing``), and ``sequence_probs`` [samples, E] (each of its sequences' sum of p, or None) from
    sample ``first`` of the set. ``coeffs``: (aux, z, sequence-wise) coefficients times the objective's weight
    per sample / tp; ``record(aux, z, T, sequence)``, when given, receives this piece's share of the losses'
    values (the sequence-wise one's None when it is off) and the set's token count (for metrics)."""

    @staticmethod
    def forward(ctx, gates, prob_sums, z_sum, sequence_probs, balance: BalanceSet, first: int, coeffs: tuple,
                record):
        ctx.balance, ctx.first, ctx.coeffs, ctx.record = balance, first, coeffs, record
        ctx.sequences = sequence_probs is not None
        ctx.save_for_backward(prob_sums.detach(), z_sum.detach(),
                              *([sequence_probs.detach()] if ctx.sequences else []))
        return gates.view_as(gates)

    @staticmethod
    def backward(ctx, grad):
        prob_sums, z_sum, *sequence_probs = ctx.saved_tensors
        fractions, tokens = ctx.balance.fractions()
        aux_coeff, z_coeff, sequence_coeff = ctx.coeffs
        samples = ctx.balance.samples
        experts = fractions.numel()
        grad_probs = fractions * (aux_coeff * samples * experts / tokens)
        grad_z = torch.full_like(z_sum, z_coeff * samples / tokens)
        grad_sequences = sequence_loss = None
        if ctx.sequences:
            sequence_fractions, per_sequence = ctx.balance.sequence_fractions()
            mine = sequence_fractions[ctx.first:ctx.first + sequence_probs[0].shape[0]]
            grad_sequences = mine * (sequence_coeff * experts / per_sequence)
            sequence_loss = experts * (mine * sequence_probs[0]).sum() / (per_sequence * samples)
        if ctx.record is not None:
            ctx.record(experts * (fractions * prob_sums).sum() / tokens, z_sum / tokens, tokens, sequence_loss)
        return grad, grad_probs, grad_z, grad_sequences, None, None, None, None
