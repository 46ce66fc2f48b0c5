"""One pre-norm transformer block: ``forward`` reads top to bottom, as nanoGPT's and Megatron's do.

Attention, the MLP and a mixture of experts are *mixers* with one two-piece interface: ``hidden(x, context)``
computes up to the row-parallel projection's input (recomputable, no forward communication) and
``project(h)`` is that projection with its all-reduce over TP (``launch(h, pieces)``: the same, left in
flight, for Domino); ``residual`` adds bias, dropout and the residual. ``forward`` runs the two phases
with synchronous all-reduces; Domino runs the same pieces per mu-chunk in the order of ``domino.order``
(``domino.executor``), looking the phases up by name in ``phases``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import LayerContext
from .attention import Attention
from .mla import LatentAttention
from .mlp import MLP
from .moe import MoE
from .norms import Norm
from .recompute import run
from .tokens import NO_CONTEXT, TokenContext


class TransformerBlock(nn.Module):
    def __init__(self, cfg, ctx: LayerContext, *, layer_number: int):
        super().__init__()
        self.layer_number, self.ctx = layer_number, ctx
        self.hidden_dropout = cfg.hidden_dropout
        self.run_phase = run  # how a phase's hidden part runs (``recompute.apply_recompute`` may recompute it)
        self.input_norm = Norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, ctx)
        self.attention = LatentAttention(cfg, ctx) if cfg.is_mla else Attention(cfg, ctx)
        self.post_attention_norm = Norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, ctx)
        self.mlp = MoE(cfg, ctx) if cfg.is_moe_layer(layer_number) else MLP(cfg, ctx)  # same phase interface
        self.phases = {"attention": (self.input_norm, self.attention), "mlp": (self.post_attention_norm, self.mlp)}

    def forward(self, x: torch.Tensor, context: TokenContext = NO_CONTEXT) -> torch.Tensor:
        """One layer with synchronous TP: each projection all-reduces (reduce-scatters under SP) in place."""
        x = self.residual(*self.attention.project(self.phase_hidden("attention", x, context)), x)  # all-reduce
        x = self.residual(*self.mlp.project(self.phase_hidden("mlp", x, context)), x)  # all-reduce
        return x

    def phase_hidden(self, phase: str, x: torch.Tensor, context: TokenContext) -> torch.Tensor:
        """norm, then the mixer's ``hidden``, through ``run_phase``."""
        norm, mixer = self.phases[phase]
        return self.run_phase(lambda x, context: mixer.hidden(norm(x), context), x, context)

    def attention_in_flight(self, x: torch.Tensor, context: TokenContext):
        """Domino's attention core apart (``parallel.cp_a2a_output_overlap``): norm, then the attention up to
        its Ulysses output all-to-alls, left in flight (``Attention.hidden_in_flight``)."""
        return self.attention.hidden_in_flight(self.input_norm(x), context)

    def projection(self, phase: str):
        """The mixer of ``phase``: its ``project`` / ``launch`` is the phase's row-parallel projection."""
        return self.phases[phase][1]

    def residual(self, reduced: torch.Tensor, bias, residual: torch.Tensor) -> torch.Tensor:
        """residual + dropout(reduced + bias); under SP the activations differ per TP rank, so the TP stream."""
        out = reduced if bias is None else reduced + bias
        if self.training and self.hidden_dropout > 0:
            if self.ctx.sequence_parallel:
                with self.ctx.tp_stream():
                    out = F.dropout(out, self.hidden_dropout)
            else:
                out = F.dropout(out, self.hidden_dropout)
        return residual + out
