"""Vocab-parallel token embedding: each TP rank holds a contiguous block of the padded vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import comm
from .layers import make_param
from .context import LayerContext
from .sharding import ParamInfo, ShardSpec, declare


def vocab_range(padded_vocab: int, tp_rank: int, tp: int) -> tuple[int, int]:
    per_rank = padded_vocab // tp
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def partial_lookup(tokens: torch.Tensor, weight: torch.Tensor, padded_vocab_size: int, ctx: LayerContext):
    """This rank's rows ``weight`` of the padded vocabulary looked up (zeros for other ranks' tokens)."""
    if ctx.size == 1:
        return F.embedding(tokens, weight)
    start, end = vocab_range(padded_vocab_size, ctx.rank, ctx.size)
    outside = (tokens < start) | (tokens >= end)
    return F.embedding((tokens - start).masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0.0)


class VocabParallelEmbedding(nn.Module):
    """Lookup of this rank's rows; other ranks' tokens give zeros, and a TP all-reduce completes the rows.

    The vocabulary is padded to a multiple of make_vocab_size_divisible_by x tp; padded rows are
    initialised to zero and are masked out of the loss, so padding never changes the result.
    """

    def __init__(self, vocab_size: int, padded_vocab_size: int, hidden_size: int, ctx: LayerContext, *,
                 init_std: float = 0.02):
        super().__init__()
        self.ctx, self.vocab_size, self.padded_vocab_size = ctx, vocab_size, padded_vocab_size
        spec = ShardSpec(0, (padded_vocab_size,))
        declare(self, "weight", make_param((spec.local_size(ctx.size), hidden_size), ctx),
                ParamInfo(spec, "normal", init_std, vocab_rows=vocab_size))  # rows past vocab_size: padding

    def partial(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the lookup (zeros for tokens of other ranks): sums to the embedding over TP."""
        return partial_lookup(tokens, self.weight, self.padded_vocab_size, self.ctx)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return comm.reduce_from_tp(self.partial(tokens), self.ctx.group)
