"""Autoregressive generation with a KV cache: the prompt in one forward, then one token per forward.

Each forward passes the new tokens, their absolute positions (RoPE and learned position tables both read them)
and the cache (``models.kv_cache``) to a whole model (one pipeline stage). The host reads each chosen token (the
one by-design sync per token: to stop at the end of a document and to print the result).
"""
from __future__ import annotations

import torch

from ..models.kv_cache import KVCache


def next_logits(model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """fp32 logits [b, vocab] after ``tokens`` [b, s], whose earlier tokens' keys and values ``cache`` holds;
    the cache then holds these tokens' too."""
    start = cache.length
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    logits = model.logits(None, {"tokens": tokens, "position_ids": positions, "kv_cache": cache})
    cache.advance(tokens.shape[1])
    return logits[:, -1]


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int, pick, stop_id: int | None = None) -> list[int]:
    """Up to ``max_new_tokens`` ids following ``prompt``, each chosen by ``pick`` (logits [vocab] -> a [1]
    token tensor, the same on every rank: ``sampling.TokenPicker``); ends after ``stop_id`` when given."""
    model.eval()
    device = next(model.parameters()).device
    cache = KVCache(len(prompt) + max_new_tokens)
    logits = next_logits(model, torch.tensor([prompt], dtype=torch.int64, device=device), cache)
    generated = []
    while True:
        token = pick(logits[0])
        generated.append(int(token.item()))  # by design: the host reads each chosen token
        if len(generated) == max_new_tokens or generated[-1] == stop_id:
            return generated
        logits = next_logits(model, token.view(1, 1), cache)
