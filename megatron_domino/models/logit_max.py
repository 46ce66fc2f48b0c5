"""Each head's largest attention logit over a step, where attention runs: what MuonClip (``optim/qk_clip.py``) bounds.

The flash kernels never form the logits, so with ``optimizer.muon_qk_clip`` set each attention call also computes
q k^T / sqrt(d) once more, without autograd, a few heads at a time, over the pairs the call attends (causal within
a document; a ring's blocks as the ring schedules them), and folds the maximum into its layer's running maximum
of this rank's heads. Micro-batches, Domino's mu-chunks and recomputed forwards fold in alike (a maximum is
idempotent); the optimizer reduces the maxima over the replicas and context-parallel ranks, uses them and resets
them (``reset``)."""
from __future__ import annotations

import torch

from .document_attention import document_spans

HEADS_AT_ONCE = 4  # heads whose [b, s, s] logits exist at once


@torch.no_grad()
def fold(running: torch.Tensor, q: torch.Tensor, k: torch.Tensor, causal: bool, heads=slice(None)) -> None:
    """running[heads] <- max(running[heads], max logit of q [b, h, sq, d] over k [b, g, sk, d]); ``causal``: key j
    of a query i is attended when j <= i + sk - sq (the kernel's alignment)."""
    if q.shape[2] == 0 or k.shape[2] == 0:
        return
    per_group = q.shape[1] // k.shape[1]
    mask = None
    if causal:
        rows = torch.arange(q.shape[2], device=q.device).unsqueeze(1)
        mask = torch.arange(k.shape[2], device=q.device).unsqueeze(0) > rows + (k.shape[2] - q.shape[2])
    maxima, k = [], k.repeat_interleave(per_group, dim=1) if per_group > 1 else k  # a key per query head
    for first in range(0, q.shape[1], HEADS_AT_ONCE):
        chunk = q[:, first:first + HEADS_AT_ONCE].float()
        keys = k[:, first:first + HEADS_AT_ONCE].float()
        logits = chunk @ keys.transpose(-1, -2) * q.shape[-1] ** -0.5
        if mask is not None:
            logits = logits.masked_fill(mask, float("-inf"))
        maxima.append(logits.amax(dim=(0, 2, 3)))
    target = running[heads]
    torch.maximum(target, torch.cat(maxima).to(running.dtype), out=target)


def fold_documents(running: torch.Tensor, q: torch.Tensor, k: torch.Tensor, doc_offsets) -> None:
    """``fold`` over causal attention within the packed documents of each row (``document_attention``'s pairs)."""
    for i, offsets in enumerate(doc_offsets.unbind(0)):
        for start, end in document_spans(offsets):
            fold(running, q[i:i + 1, :, start:end], k[i:i + 1, :, start:end], True)


def trackers(chunks) -> list:
    """Turn the tracking on in every attention layer of ``chunks``; returns (the fused QKV weight, its heads
    layout, the running maxima of this rank's heads) per layer, for the optimizer's MuonClip."""
    found = []
    for chunk in chunks:
        for module in chunk.modules():
            if hasattr(module, "logit_max") and hasattr(module, "qkv"):  # ``attention.Attention``'s fused QKV
                heads = module.local_groups * module.queries_per_group
                module.logit_max = torch.full((heads,), float("-inf"), device=module.qkv.weight.device)
                found.append((module.qkv.weight, module.qkv.param_info["weight"].heads, module.logit_max))
    return found
