"""Turn L + 1 packed tokens into one training sample: inputs, labels, loss mask, positions, document offsets.

Shared by the real and the synthetic datasets so that the EOD flags behave identically in both. An EOD
token belongs to the document it ends; the next document starts right after it.
"""
from __future__ import annotations

import numpy as np
import torch


def make_sample(tokens: np.ndarray, eod: int, reset_position_ids: bool = False, reset_attention_mask: bool = False,
                eod_mask_loss: bool = False) -> dict:
    """The sample dict for ``tokens`` (length L + 1).

    * ``tokens`` / ``labels``: int64 [L], labels are the inputs shifted by one;
    * ``loss_mask``: float32 [L]; with ``eod_mask_loss`` the prediction made *from* an EOD input (the first
      token of the next, unrelated document) is masked, as in Megatron. Packed samples are never padded;
    * ``position_ids``: int64 [L], restarting at 0 after each EOD when ``reset_position_ids``;
    * ``doc_offsets``: int32 [n_docs + 1], only with ``reset_attention_mask``: 0, each later document's start,
      L (cu_seqlens-style). Attention stays causal within each document; offsets instead of an [L, L] mask keep
      the memory O(L) and the flash kernel usable (``models.document_attention``).
    """
    full = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    inputs, labels = full[:-1].clone(), full[1:].clone()
    length = inputs.numel()
    is_eod = inputs == eod
    loss_mask = torch.ones(length, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    positions = torch.arange(length, dtype=torch.int64)
    sample = {"tokens": inputs, "labels": labels, "loss_mask": loss_mask}
    if reset_position_ids or reset_attention_mask:
        starts_here = _starts(is_eod)
        if reset_position_ids:
            document_start = torch.cummax(torch.where(starts_here, positions, 0), 0).values
            positions = positions - document_start
        if reset_attention_mask:
            sample["doc_offsets"] = _offsets(starts_here)
    sample["position_ids"] = positions
    return sample


def _starts(is_eod: torch.Tensor) -> torch.Tensor:
    """[L] bool: a document starts here (position 0, and after each EOD but the last position's)."""
    starts_here = torch.zeros(len(is_eod), dtype=torch.bool)
    starts_here[0] = True
    starts_here[1:] = is_eod[:-1]
    return starts_here


def _offsets(starts_here: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.nonzero(starts_here).flatten(), torch.tensor([len(starts_here)])]).to(torch.int32)


def attention_layout(tokens: np.ndarray, eod: int, reset_attention_mask: bool) -> dict:
    """What balanced packing reads of a sample (``data.attention_balance``), without building the rest of it:
    its inputs (a view) and, with ``reset_attention_mask``, the ``doc_offsets`` ``make_sample`` gives."""
    inputs = torch.from_numpy(np.asarray(tokens, dtype=np.int64))[:-1]
    return {"tokens": inputs, **({"doc_offsets": _offsets(_starts(inputs == eod))} if reset_attention_mask else {})}
