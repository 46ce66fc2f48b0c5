"""One pre-norm transformer block: ``forward`` reads top to bottom, as nanoGPT's and Megatron's do.

Each of its two phases (attention, MLP) ends where tensor parallelism communicates: ``phase_hidden``
computes up to the row-parallel projection's input (recomputable, no forward communication),
``projection`` is that row-parallel layer (its all-reduce; for a mixture of experts, every expert's fc2
combined under one all-reduce, see ``moe``), and ``residual`` adds bias, dropout and the residual.
``forward`` runs them in order with synchronous all-reduces; Domino runs the same pieces per mu-chunk in
the order of ``domino.order`` (``domino.executor``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import LayerContext
from .attention import Attention
from .mlp import MLP
from .moe import MoE
from .norms import Norm
from .recompute import recompute


class TransformerBlock(nn.Module):
    def __init__(self, cfg, ctx: LayerContext, *, layer_number: int):
        super().__init__()
        self.layer_number, self.ctx = layer_number, ctx
        self.hidden_dropout, self.full_recompute = cfg.hidden_dropout, cfg.recompute == "full"
        self.input_norm = Norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, ctx)
        self.attention = Attention(cfg, ctx)
        self.post_attention_norm = Norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, ctx)
        self.mlp = MoE(cfg, ctx) if cfg.is_moe_layer(layer_number) else MLP(cfg, ctx)  # same phase interface

    def forward(self, x: torch.Tensor, rotary=None, doc_offsets=None) -> torch.Tensor:
        """One layer with synchronous TP: each projection all-reduces (reduce-scatters under SP) in place."""
        h = self.phase_hidden("attention", x, rotary, doc_offsets)  # norm, QKV, attention
        x = self.residual(*self.attention.proj(h), x)  # output projection: all-reduce over TP
        h = self.phase_hidden("mlp", x, rotary, doc_offsets)  # norm, (routing,) fc1, activation
        return self.residual(*self.mlp.project(h), x)  # fc2 (of each expert): all-reduce over TP

    def _attention_hidden(self, x, rotary, doc_offsets):
        return self.attention.context(self.input_norm(x), rotary, doc_offsets)

    def _mlp_hidden(self, x):
        return self.mlp.hidden(self.post_attention_norm(x))

    def phase_hidden(self, phase: str, x: torch.Tensor, rotary, doc_offsets) -> torch.Tensor:
        if phase == "attention":
            args = (self._attention_hidden, x, rotary, doc_offsets)
        else:
            args = (self._mlp_hidden, x)
        return recompute(*args, rng=self.ctx.rng) if self.full_recompute else args[0](*args[1:])

    def projection(self, phase: str):
        return self.attention.proj if phase == "attention" else self.mlp

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
