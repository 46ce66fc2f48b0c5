"""The feed-forward block: GeLU (GPT) or SwiGLU (Llama), column- then row-parallel."""
from __future__ import annotations

import math

import torch.nn.functional as F
from torch import nn

from ..config.schema import ACTIVATIONS
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear, LayerContext


def check_mlp_split(c, cfg, tp: int) -> None:
    """TP gives each rank ffn / tp of the width (both SwiGLU halves alike); ``c`` is a ``config.checks.Checks``."""
    c.split_by_tp("model.ffn_hidden_size", cfg.ffn_size, tp)


class MLP(nn.Module):
    """``ffn``: the width (default the model's); mixture-of-experts layers build their experts from it."""

    def __init__(self, cfg, ctx: LayerContext, ffn: int | None = None):
        super().__init__()
        if cfg.activation not in ACTIVATIONS:
            raise ValueError(f"model.activation = {cfg.activation!r}: must be one of {ACTIVATIONS}")
        self.activation, ffn = cfg.activation, ffn or cfg.ffn_size
        parts = (ffn, ffn) if cfg.activation == "swiglu" else (ffn,)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, sum(parts), ctx, parts=parts, bias=cfg.bias,
                                        init_std=cfg.init_std)
        self.fc2 = RowParallelLinear(ffn, cfg.hidden_size, ctx, bias=cfg.bias,
                                     init_std=cfg.init_std / math.sqrt(2 * cfg.num_layers))

    def hidden(self, x, context=None):
        """Everything up to the second projection: [b, s, h] -> this rank's [b, s, ffn / tp] (the tokens'
        ``context``, part of the phase interface, changes nothing here)."""
        return self.activate(self.fc1(x))

    def activate(self, y):
        """The activation of fc1's local output (SwiGLU: this rank's gate and up halves)."""
        if self.activation == "swiglu":
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(y, approximate="tanh" if self.activation == "gelu_tanh" else "none")

    def project(self, hidden):
        """fc2 with its synchronous all-reduce (reduce-scatter under SP): (output, bias)."""
        return self.fc2(hidden)

    def launch(self, hidden, pieces: int = 1):
        """Domino: fc2 with its all-reduce left in flight."""
        return self.fc2.launch(hidden, pieces)
