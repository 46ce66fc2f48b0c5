"""Vocab-parallel token embedding: each TP rank holds a contiguous block of the padded vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import comm
from .layers import make_param
from .sharding import ShardSpec


def vocab_range(padded_vocab: int, tp_rank: int, tp: int) -> tuple[int, int]:
    per_rank = padded_vocab // tp
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


class VocabParallelEmbedding(nn.Module):
    """Lookup of this rank's rows; other ranks' tokens give zeros, and a TP all-reduce completes the rows.

    The vocabulary is padded to a multiple of make_vocab_size_divisible_by x tp; padded rows are
    initialised to zero and are masked out of the loss, so padding never changes the result.
    """

    def __init__(self, vocab_size: int, padded_vocab_size: int, hidden_size: int, group, *,
                 init_std: float = 0.02, dtype=torch.float32, device=None):
        super().__init__()
        self.group, self.tp = group, comm.group_size(group)
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size
        tp_rank = torch.distributed.get_rank(group) if self.tp > 1 else 0
        self.start, self.end = vocab_range(padded_vocab_size, tp_rank, self.tp)
        spec = ShardSpec(0, (padded_vocab_size,))
        self.weight = make_param((spec.local_size(self.tp), hidden_size), dtype, device, "normal", init_std, spec)
        self.weight.vocab_rows = vocab_size  # rows past this are padding (zero-initialised)

    def partial(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the lookup (zeros for tokens of other ranks): sums to the embedding over TP."""
        if self.tp == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        return F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return comm.reduce_from_tp(self.partial(tokens), self.group)
