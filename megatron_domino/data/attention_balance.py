"""Balanced packing (``data.balance_attention``; Megatron's dynamic CP answers the same problem): which samples of
the global batch train together in one micro-batch, and on which data-parallel rank (``MicroBatchLoader`` hands
rank r the r-th share of the arranged micro-batches), so that every micro-batch, context-parallel rank and
data-parallel rank gets about the same attention work.

Packed documents attend only within themselves (``data.reset_attention_mask``): a sample holding one long
document costs about L² / 2 of attention, one holding many short ones far less, and under ring attention's fixed
zig-zag chunks a CP rank's share depends on where the documents fall. The micro-batches of a pipelined step, and
the ranks of a ring, wait for their slowest member, so an unlucky draw slows the whole step.

The work of a query at position p is the number of keys it attends: p minus its document's start, plus one. A CP
rank's work in a sample sums over the queries it holds (``ring_attention.chunk_starts``). Under ``a2a`` every
rank computes every query for its slice of the heads, so the ranks share each sample equally and only the
micro-batches can differ; under ``a2a+ring`` a ring member's queries are shared by its all-to-all group.

Nothing that is trained changes: the step holds the same samples, each whole (documents whole and in order), the
loss is normalised by the step's token count, and the consumed-sample count moves as before. Only the order of
the fp32 sums does. A micro-batch keeps its samples in dataset order and the micro-batches are ordered by their
first sample, so every rank that reads the step (first and last pipeline stage, every CP and DP rank) arranges
it alike.

The arrangement: largest sample first, each into the micro-batch with room whose busiest CP rank stays least
busy; then, while the busiest cell is above the mean by more than ``data.balance_tolerance``, the swap of one of
its micro-batch's samples with another micro-batch's that lowers that peak most.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from ..models.ring_attention import local_positions


def query_work(doc_offsets: torch.Tensor | None, length: int) -> np.ndarray:
    """Keys attended by each query position of a sample (causal, within its document)."""
    positions = np.arange(length, dtype=np.int64)
    if doc_offsets is None:
        return positions + 1
    offsets = np.asarray(doc_offsets, dtype=np.int64)
    starts = offsets[np.searchsorted(offsets, positions, side="right") - 1]
    return positions - starts + 1


def rank_work(sample: dict, cp_size: int, cp_comm: str = "ring", a2a_size: int = 1) -> np.ndarray:
    """Attention work of each CP rank in ``sample`` (float64 [cp]), under ``parallel.cp_comm``'s layout."""
    length = sample["tokens"].shape[-1]
    work = query_work(sample.get("doc_offsets"), length)
    if cp_size == 1 or cp_comm == "a2a":
        return np.full(cp_size, work.sum() / cp_size)
    group = a2a_size if cp_comm == "a2a+ring" else 1
    members = [work[held].sum() for held in _ring_members_positions(length, cp_size // group)]
    return np.repeat(np.asarray(members, dtype=np.float64) / group, group)


@functools.lru_cache(maxsize=8)
def _ring_members_positions(length: int, ring: int) -> tuple[np.ndarray, ...]:
    """Each ring member's token positions: the same for every sample of a run, so made once."""
    return tuple(local_positions(length, ring, member).numpy() for member in range(ring))


def imbalance(loads: np.ndarray) -> float:
    """The busiest (micro-batch, CP rank) cell over the mean cell, minus one: 0 is perfect balance."""
    mean = float(loads.mean())
    return float(loads.max()) / mean - 1.0 if mean > 0 else 0.0


def arrange(works: np.ndarray, micro_batch: int, tolerance: float) -> tuple[list[int], float, float]:
    """(sample order, imbalance before, imbalance after) for per-sample works [n, cp] cut into micro-batches of
    ``micro_batch`` samples (module docstring)."""
    n, cp = works.shape
    count = n // micro_batch
    before = imbalance(works.reshape(count, micro_batch, cp).sum(1))
    bins, loads = [[] for _ in range(count)], np.zeros((count, cp))
    for i in sorted(range(n), key=lambda i: (-works[i].max(), -works[i].sum(), i)):
        room = [j for j in range(count) if len(bins[j]) < micro_batch]
        j = min(room, key=lambda j: ((loads[j] + works[i]).max(), loads[j].sum(), j))
        bins[j].append(i)
        loads[j] += works[i]
    _lower_the_peak(bins, loads, works, tolerance)
    order = [i for members in sorted(sorted(members) for members in bins) for i in members]
    return order, before, imbalance(loads)


def _lower_the_peak(bins: list[list[int]], loads: np.ndarray, works: np.ndarray, tolerance: float) -> None:
    """Swap a sample of the busiest micro-batch with another micro-batch's while that lowers the busiest cell."""
    home = np.empty(len(works), dtype=np.int64)
    for j, members in enumerate(bins):
        home[members] = j
    target = loads.mean() * (1 + tolerance)
    for _ in range(len(works)):  # each swap lowers the peak of one micro-batch: bounded, but cap it anyway
        worst = int(loads.max(1).argmax())
        peak = loads[worst].max()
        if peak <= target:
            return
        best = (peak, None, None)
        for a in bins[worst]:
            delta = works - works[a]  # swapping a with each sample b: worst gains delta[b], b's micro-batch loses it
            peaks = np.maximum((loads[worst] + delta).max(1), (loads[home] - delta).max(1))
            peaks[home == worst] = np.inf
            b = int(peaks.argmin())
            if peaks[b] < best[0] * (1 - 1e-12):
                best = (peaks[b], a, b)
        _, a, b = best
        if a is None:
            return
        other = int(home[b])
        bins[worst][bins[worst].index(a)], bins[other][bins[other].index(b)] = b, a
        loads[worst] += works[b] - works[a]
        loads[other] += works[a] - works[b]
        home[a], home[b] = other, worst


class AttentionBalancer:
    """Arranges each training step's samples (``MicroBatchLoader``'s ``arrange``) and keeps the imbalance before
    and after, averaged over the steps since the last ``take`` (the metrics' window)."""

    def __init__(self, micro_batch: int, tolerance: float, cp_size: int, cp_comm: str = "ring", a2a_size: int = 1):
        self.micro_batch, self.tolerance = micro_batch, tolerance
        self.cp_size, self.cp_comm, self.a2a_size = cp_size, cp_comm, a2a_size
        self._sums, self._steps = np.zeros(2), 0

    def __call__(self, samples: list[dict]) -> list[int]:
        works = np.stack([rank_work(s, self.cp_size, self.cp_comm, self.a2a_size) for s in samples])
        order, before, after = arrange(works, self.micro_batch, self.tolerance)
        self._sums += (before, after)
        self._steps += 1
        return order

    def take(self) -> dict:
        """{"attention_imbalance_before", "_after"}: the window's means (empty if no step was arranged)."""
        if not self._steps:
            return {}
        before, after = self._sums / self._steps
        self._sums, self._steps = np.zeros(2), 0
        return {"attention_imbalance_before": float(before), "attention_imbalance_after": float(after)}
