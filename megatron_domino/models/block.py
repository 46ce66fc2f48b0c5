"""One pre-norm transformer block, exposed as two phases for the Domino schedule.

Each phase (attention, MLP) is split where tensor parallelism communicates: ``phase_hidden``
computes up to the row-parallel projection's input (recomputable, no forward communication),
``projection`` is that row-parallel layer, and ``residual`` adds bias, dropout and the residual
once the projection's all-reduce has completed. The schedule in ``domino.schedule`` decides
when each all-reduce is launched and waited.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.random import get_tracker
from .attention import Attention
from .mlp import MLP
from .norms import Norm
from .recompute import recompute


class TransformerBlock(nn.Module):
    def __init__(self, cfg, group, *, layer_number: int, grad_pieces: int = 0, sequence_parallel: bool = False,
                 dtype=torch.float32, device=None):
        super().__init__()
        self.layer_number = layer_number
        self.hidden_dropout, self.full_recompute = cfg.hidden_dropout, cfg.recompute == "full"
        self.sequence_parallel = sequence_parallel
        common = dict(grad_pieces=grad_pieces, sequence_parallel=sequence_parallel, dtype=dtype, device=device)
        self.input_norm = Norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, sequence_parallel=sequence_parallel,
                               dtype=dtype, device=device)
        self.attention = Attention(cfg, group, **common)
        self.post_attention_norm = Norm(cfg.norm, cfg.hidden_size, cfg.norm_eps,
                                        sequence_parallel=sequence_parallel, dtype=dtype, device=device)
        self.mlp = MLP(cfg, group, **common)

    def _attention_hidden(self, x, rotary, attention_mask):
        return self.attention.context(self.input_norm(x), rotary, attention_mask)

    def _mlp_hidden(self, x):
        return self.mlp.hidden(self.post_attention_norm(x))

    def phase_hidden(self, phase: str, x: torch.Tensor, rotary, attention_mask) -> torch.Tensor:
        if phase == "attention":
            args = (self._attention_hidden, x, rotary, attention_mask)
        else:
            args = (self._mlp_hidden, x)
        return recompute(*args) if self.full_recompute else args[0](*args[1:])

    def projection(self, phase: str):
        return self.attention.proj if phase == "attention" else self.mlp.fc2

    def residual(self, reduced: torch.Tensor, bias, residual: torch.Tensor) -> torch.Tensor:
        """residual + dropout(reduced + bias); under SP the activations differ per TP rank, so the TP stream."""
        out = reduced if bias is None else reduced + bias
        if self.training and self.hidden_dropout > 0:
            if self.sequence_parallel:
                with get_tracker().fork():
                    out = F.dropout(out, self.hidden_dropout)
            else:
                out = F.dropout(out, self.hidden_dropout)
        return residual + out
