"""Where a rank's elements sit in the full tensor, as rectangles: what a sharded checkpoint stores.

A sharded checkpoint keeps every tensor at its full (global) shape and writes each rank's elements as
rectangles at global offsets, so a run at another layout reads exactly the rectangles it needs. A rank
holds either its whole TP-local tensor (weights) or a flat range of it (a ZeRO shard of the optimizer
state). A flat range of a row-major matrix is at most three rectangles (a partial row, whole rows, a
partial row); each is then cut at the TP parts (SwiGLU's gate and up halves land in different places of
the full tensor) and clipped to the vocabulary (padding rows are never stored, so any TP size pads anew).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .sharding import ParamInfo


@dataclass(frozen=True)
class Region:
    """A rectangle of the full tensor (``offsets``, ``sizes``) and the local view holding its elements."""

    offsets: tuple[int, ...]
    view: torch.Tensor

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.view.shape)


def tp_size_of(local_shape, info: ParamInfo) -> int:
    """The TP size a local tensor was cut for (the full size over the local size along the split dimension)."""
    if info.spec is None:
        return 1
    return info.spec.full_size // local_shape[info.spec.dim]


def stored_shape(local_shape, info: ParamInfo) -> tuple[int, ...]:
    """The stored shape: the full tensor's, vocabulary padding removed."""
    shape = info.full_shape(local_shape)
    return (info.vocab_rows, *shape[1:]) if info.vocab_rows is not None else shape


def _flat_blocks(shape, start: int, end: int):
    """(local offsets, block shape, flat start) of the rectangles covering flat elements [start, end)."""
    if len(shape) == 1:
        if end > start:
            yield (start,), (end - start,), start
        return
    if len(shape) != 2:
        raise ValueError(f"sharded checkpoints store 1-D and 2-D parameters; got shape {tuple(shape)}")
    cols, at = shape[1], start
    if at % cols and at < end:  # a partial first row
        width = min(cols - at % cols, end - at)
        yield (at // cols, at % cols), (1, width), at
        at += width
    rows = (end - at) // cols
    if rows:
        yield (at // cols, 0), (rows, cols), at
        at += rows * cols
    if at < end:
        yield (at // cols, 0), (1, end - at), at


def _to_full(offsets, block: torch.Tensor, info: ParamInfo, tp_rank: int, tp: int):
    """Cut a local rectangle at the TP parts and place each cut in the full tensor."""
    if info.spec is None or tp == 1:
        yield tuple(offsets), block
        return
    dim, local_begin, full_begin = info.spec.dim, 0, 0
    lo, hi = offsets[dim], offsets[dim] + block.shape[dim]
    for part in info.spec.parts:
        piece = part // tp
        cut_lo, cut_hi = max(lo, local_begin), min(hi, local_begin + piece)
        if cut_lo < cut_hi:
            placed = list(offsets)
            placed[dim] = full_begin + tp_rank * piece + (cut_lo - local_begin)
            yield tuple(placed), block.narrow(dim, cut_lo - lo, cut_hi - cut_lo)
        local_begin, full_begin = local_begin + piece, full_begin + part


def _clip_vocab(offsets, view: torch.Tensor, info: ParamInfo):
    if info.vocab_rows is None or offsets[0] + view.shape[0] <= info.vocab_rows:
        return view
    return view.narrow(0, 0, max(0, info.vocab_rows - offsets[0]))


def regions(local: torch.Tensor, info: ParamInfo, tp_rank: int, start: int = 0, end: int | None = None,
            flat: torch.Tensor | None = None) -> list[Region]:
    """The rectangles of the full tensor holding elements [start, end) of the flattened TP-local tensor
    ``local`` (default: all of it). ``flat``: a 1-D tensor holding those elements instead of ``local``
    (a ZeRO shard's master weight or Adam moment); the views are then into ``flat``."""
    end = local.numel() if end is None else end
    tp = tp_size_of(local.shape, info)
    source = flat if flat is not None else local.reshape(-1)[start:end]
    out = []
    for offsets, shape, flat_start in _flat_blocks(local.shape, start, end):
        block = source[flat_start - start:flat_start - start + math.prod(shape)].view(shape)
        for placed, view in _to_full(offsets, block, info, tp_rank, tp):
            view = _clip_vocab(placed, view, info)
            if view.numel():
                out.append(Region(placed, view))
    return out
