"""What a block needs besides its hidden state: the context of the tokens it holds.

Passed explicitly through every layer (and per Domino mu-chunk), so no layer keeps per-step state: the
rotary tables of these tokens' positions, the document offsets of packed sequences (host memory), and
the weight of the auxiliary losses per sample (MoE), which the pipeline engine sets for each step, and
where the MoE layers meet the micro-batch's other routing pieces (``balance``). During generation it also
carries the KV cache (``kv_cache.py``), which the attention layers read and extend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import KVCache


@dataclass(frozen=True)
class TokenContext:
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) per position, [b, s, d]
    doc_offsets: torch.Tensor | None = None  # [b, documents + 1] per sample, in host memory
    aux_loss_weight: float = 1.0  # loss scale / samples the loss is averaged over (``models.moe``)
    balance: dict | None = None  # MoE layer -> its ``BalanceSet`` for this micro-batch (None: each call alone)
    pieces: int = 1  # routing pieces of the micro-batch on this rank (Domino's mu-chunks)
    cache: KVCache | None = None  # generation: earlier tokens' keys and values (never set in training)
    microbatch: int | None = None  # the micro-batch's index in the step (the global balance loss); None: no step

    def rows(self, rows: slice, pieces: int) -> "TokenContext":
        """The context of the samples ``rows`` (a Domino mu-chunk, one of ``pieces``); generation runs no Domino,
        so there is no cache to cut."""
        return TokenContext(None if self.rotary is None else tuple(t[rows] for t in self.rotary),
                            None if self.doc_offsets is None else self.doc_offsets[rows], self.aux_loss_weight,
                            self.balance, pieces, microbatch=self.microbatch)


NO_CONTEXT = TokenContext()
