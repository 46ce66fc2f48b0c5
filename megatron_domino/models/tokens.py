"""What a block needs besides its hidden state: the context of the tokens it holds.

Passed explicitly through every layer (and per Domino mu-chunk): the rotary tables of these tokens' positions,
the document offsets of packed sequences (host memory), and where the MoE layers meet the micro-batch's other
routing pieces (``balance``). During generation it also carries the KV cache (``kv_cache.py``), which the
attention layers read and extend. Facts of the training step (the MoE losses' weight) are not the tokens': the
objective hands them to the layers once per step (``LanguageModel.begin_step``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import KVCache


@dataclass(frozen=True)
class TokenContext:
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) per position, [b, s, d]
    doc_offsets: torch.Tensor | None = None  # [b, documents + 1] per sample, in host memory
    balance: dict | None = None  # MoE layer -> its ``BalanceSet`` for this micro-batch (None: each call alone)
    pieces: int = 1  # routing pieces of the micro-batch on this rank (Domino's mu-chunks)
    cache: KVCache | None = None  # generation: earlier tokens' keys and values (never set in training)

    def rows(self, rows: slice, pieces: int) -> "TokenContext":
        """The context of the samples ``rows`` (a Domino mu-chunk, one of ``pieces``); generation runs no Domino,
        so there is no cache to cut."""
        return TokenContext(None if self.rotary is None else tuple(t[rows] for t in self.rotary),
                            None if self.doc_offsets is None else self.doc_offsets[rows], self.balance, pieces)


NO_CONTEXT = TokenContext()
