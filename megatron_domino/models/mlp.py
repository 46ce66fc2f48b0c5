"""The feed-forward block: GeLU (GPT) or SwiGLU (Llama), column- then row-parallel."""
from __future__ import annotations

import math

import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")


class MLP(nn.Module):
    def __init__(self, cfg, group, *, grad_pieces: int, sequence_parallel: bool, dtype, device):
        super().__init__()
        if cfg.activation not in ACTIVATIONS:
            raise ValueError(f"model.activation = {cfg.activation!r}: must be one of {ACTIVATIONS}")
        self.activation, ffn = cfg.activation, cfg.ffn_size
        parts = (ffn, ffn) if cfg.activation == "swiglu" else (ffn,)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, sum(parts), group, parts=parts, bias=cfg.bias,
                                        sequence_parallel=sequence_parallel, grad_pieces=grad_pieces,
                                        init_std=cfg.init_std, dtype=dtype, device=device)
        self.fc2 = RowParallelLinear(ffn, cfg.hidden_size, group, bias=cfg.bias, sequence_parallel=sequence_parallel,
                                     init_std=cfg.init_std / math.sqrt(2 * cfg.num_layers), dtype=dtype, device=device)

    def hidden(self, x):
        """Everything up to the second projection: [b, s, h] -> this rank's [b, s, ffn / tp]."""
        y = self.fc1(x)
        if self.activation == "swiglu":
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(y, approximate="tanh" if self.activation == "gelu_tanh" else "none")
