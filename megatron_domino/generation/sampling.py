"""How the next token is chosen from the logits: greedy, or sampled with temperature, top-k and top-p.

Under TP every rank holds the same full-vocabulary logits, but only the first rank chooses (its generator seeded
by ``seed``, so a run is reproducible) and broadcasts the token to all: every rank then goes on with the same
one, even where its logits differ in the last bit (a data-parallel replica's experts computed elsewhere, a
reduction in another order). The token stays on the device for the broadcast (NCCL takes device tensors only).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (the most likely token)
    top_k: int = 0  # 0: every token; k: only the k most likely
    top_p: float = 1.0  # 1: every token; p: the fewest most likely tokens whose probability reaches p
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """One token id (a [1] tensor) drawn from ``logits`` [vocab] as ``sampling`` says (as HF: temperature,
    then top-k, then top-p)."""
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        probs = ordered.softmax(-1)
        # drop a token when the more likely ones before it already reach top_p (the most likely always stays)
        dropped = (probs.cumsum(-1) - probs) >= sampling.top_p
        logits = logits.scatter(0, order, ordered.masked_fill(dropped, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


class TokenPicker:
    """Chooses each next token on global rank 0 and broadcasts it to every rank (each calls it, in step)."""

    def __init__(self, sampling: Sampling, device: torch.device, vocab: int):
        """``vocab``: the tokenizer's vocabulary, the ids a choice may take (a padded model vocabulary has more)."""
        self.sampling, self.vocab = sampling, vocab
        self.generator = None if sampling.greedy else torch.Generator(device=device).manual_seed(sampling.seed)
        self.shared = dist.is_initialized() and dist.get_world_size() > 1
        self.chooses = not self.shared or dist.get_rank() == 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token, a [1] int64 device tensor equal on every rank, from the last position's ``logits``."""
        if self.chooses:
            logits = logits[:self.vocab]
            token = logits.argmax(-1, keepdim=True) if self.sampling.greedy else \
                sample(logits, self.sampling, self.generator)
        else:
            token = torch.empty(1, dtype=torch.int64, device=logits.device)
        if self.shared:
            dist.broadcast(token, 0)
        return token
