"""The keys and values of the tokens already seen, per attention layer, so that generation computes only the new
tokens' attention at each step (``generation.decode``).

The attention layers meet the cache through one hook: ``TokenContext.cache`` (the language model takes it from
``batch["kv_cache"]``). With it, ``AttentionPhase.attend`` hands this step's queries, keys and values (rotated at
their absolute positions) here instead of to the training core; training never sets it, so its numerics are
untouched. A rank keeps only its own heads, as the layers compute them under TP. The buffers are allocated at a
layer's first step, for ``capacity`` tokens; ``advance`` moves past a step's tokens once every layer has run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    def __init__(self, capacity: int):
        self.capacity, self.length = capacity, 0
        self._keys: dict[int, torch.Tensor] = {}  # id(layer) -> [b, heads, capacity, d]
        self._values: dict[int, torch.Tensor] = {}

    def attend(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this step's queries [b, heads, s, d] over the cached tokens and this step's own
        (whose keys and values [b, kv heads, s, d] are stored for the next steps): [b, heads, s, d_v]."""
        start, end = self.length, self.length + q.shape[2]
        if end > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} tokens; this step would reach {end}")
        keys = _store(self._keys, layer, k, start, end, self.capacity)
        values = _store(self._values, layer, v, start, end, self.capacity)
        grouped = q.shape[1] != keys.shape[1]
        if start == 0:  # the prompt: plain causal attention among its own tokens
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=grouped)
        # query i sits at position start + i and sees every key up to it
        mask = (torch.arange(end, device=q.device).unsqueeze(0) <=
                torch.arange(start, end, device=q.device).unsqueeze(1))
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=grouped)

    def advance(self, tokens: int) -> None:
        """Every layer has stored this step's ``tokens``: the next step's start after them."""
        self.length += tokens


def _store(buffers: dict, layer, x: torch.Tensor, start: int, end: int, capacity: int) -> torch.Tensor:
    """Write ``x`` [b, heads, s, d] at positions [start, end) of the layer's buffer; its view up to ``end``."""
    buffer = buffers.get(id(layer))
    if buffer is None:
        buffer = buffers[id(layer)] = x.new_empty(*x.shape[:2], capacity, x.shape[3])
    buffer[:, :, start:end] = x
    return buffer[:, :, :end]
