"""What a block needs besides its hidden state: the context of the tokens it holds.

Passed explicitly through every layer (and per Domino mu-chunk), so no layer keeps per-step state: the
rotary tables of these tokens' positions, the document offsets of packed sequences (host memory), and
the weight of the auxiliary losses per sample (MoE), which the pipeline engine sets for each step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenContext:
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) per position, [b, s, d]
    doc_offsets: torch.Tensor | None = None  # [b, documents + 1] per sample, in host memory
    aux_loss_weight: float = 1.0  # loss scale / samples the loss is averaged over (``models.moe``)

    def rows(self, rows: slice) -> "TokenContext":
        """The context of the samples ``rows`` (a Domino mu-chunk)."""
        return TokenContext(None if self.rotary is None else tuple(t[rows] for t in self.rotary),
                            None if self.doc_offsets is None else self.doc_offsets[rows], self.aux_loss_weight)


NO_CONTEXT = TokenContext()
