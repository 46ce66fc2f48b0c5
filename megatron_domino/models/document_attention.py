"""Exact causal attention within packed documents, in O(L) memory and on any SDPA kernel.

A dense [L, L] document mask costs O(L^2) memory (+580 MiB at L = 8192) and keeps SDPA off the flash
kernel, which takes no mask. Attention confined to causal blocks on the diagonal needs no mask at all:
each document is one causal SDPA call on its slice of q, k and v, and the outputs are concatenated back.
The document boundaries come as cu_seqlens-style offsets in host memory (``data.sample``), so slicing
reads no device value. The result is exactly the dense-masked one; only the kernel calls are per document.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def document_spans(offsets: torch.Tensor | Sequence[int]) -> list[tuple[int, int]]:
    """One row of offsets (0, starts..., L, then L repeated as padding) -> [(start, end)] of its non-empty
    documents. Pure, so that other attention schemes (ring attention) can share the layout's reading."""
    bounds = offsets.tolist() if torch.is_tensor(offsets) else list(offsets)
    if any(end < start for start, end in zip(bounds, bounds[1:])):
        raise ValueError(f"document offsets must not decrease: {bounds}")
    return [(start, end) for start, end in zip(bounds, bounds[1:]) if end > start]


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_offsets: torch.Tensor, *,
                       dropout_p: float = 0.0, enable_gqa: bool = False) -> torch.Tensor:
    """Causal attention of q [b, heads, s, d] over k, v [b, groups, s, d] within the documents of each row of
    ``doc_offsets`` [b, n + 1]. SDPA runs per document, so the caller's kernel pin and RNG fork apply."""
    length, rows = q.shape[2], []
    for i, offsets in enumerate(doc_offsets.unbind(0)):
        spans = document_spans(offsets)
        if not spans or spans[0][0] != 0 or spans[-1][1] != length:
            raise ValueError(f"document offsets of row {i} must run from 0 to the sequence length {length}: "
                             f"{offsets.tolist()}")
        pieces = [F.scaled_dot_product_attention(q[i:i + 1, :, start:end], k[i:i + 1, :, start:end],
                                                 v[i:i + 1, :, start:end], dropout_p=dropout_p, is_causal=True,
                                                 enable_gqa=enable_gqa)
                  for start, end in spans]
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)
