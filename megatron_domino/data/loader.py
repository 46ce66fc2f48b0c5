"""Hands each data-parallel rank its slice of every global batch, resumable from the consumed-sample count.

The next global batch is samples ``[c, c + G)`` of the dataset, c being the samples consumed so far (so
global batch g is ``[g*G, (g+1)*G)`` while G stays fixed, and a run may resume with another G). DP rank r
takes the contiguous block ``[c + r*G/dp, c + (r+1)*G/dp)`` and splits it into micro-batches in order (with
``data.balance_attention``, every rank arranges the whole global batch alike, ``attention_balance``, and takes
the r-th G/dp of the arranged micro-batches).
Concatenating the ranks' blocks therefore gives the same global batch for any dp, and the position in
the data is one number (the samples consumed) that a checkpoint can store and any layout can resume from.

When the dataset runs out, indexing wraps to its start (a further pass over the same samples) with a
warning: datasets are built to hold the samples the run asked for, so this happens only to evaluation
loaders or runs extended beyond their planned length.

Only pipeline stages that consume tokens (the first) or labels and loss masks (the last) need a loader;
the trainer does not create one on the other stages.
"""
from __future__ import annotations

import warnings

import torch

from megatron_domino.config.errors import DataError


class MicroBatchLoader:
    """Micro-batches of this DP rank for successive global batches."""

    def __init__(self, dataset, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0, arrange=None):
        per_step = micro_batch_size * dp_size
        if micro_batch_size <= 0 or dp_size <= 0 or global_batch_size <= 0 or global_batch_size % per_step:
            raise ValueError(f"train.global_batch_size={global_batch_size} must be a positive multiple of "
                             f"train.micro_batch_size ({micro_batch_size}) x data-parallel size ({dp_size}); set it to "
                             f"{per_step * max(1, round(global_batch_size / max(per_step, 1)))}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp_size})")
        if len(dataset) == 0:
            raise DataError("the dataset is empty. Fix: check data.path and data.split")
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._consumed = int(consumed_samples)
        self._warned_wrap = False
        self.arrange = arrange  # samples -> their order, micro-batch after micro-batch (``attention_balance``)

    @property
    def consumed_samples(self) -> int:
        """Samples of all DP ranks consumed so far (global count)."""
        return self._consumed

    def step_sample_ids(self) -> list[int]:
        """Dataset indices of the whole next global batch, every DP rank's block in rank order."""
        if self._consumed + self.global_batch_size > len(self.dataset) and not self._warned_wrap:
            warnings.warn(f"the dataset's {len(self.dataset)} samples are exhausted after {self._consumed} consumed; "
                          f"wrapping to its start", stacklevel=3)
            self._warned_wrap = True
        return [(self._consumed + k) % len(self.dataset) for k in range(self.global_batch_size)]

    def rank_sample_ids(self) -> list[int]:
        """Dataset indices this rank reads in the next global batch, in micro-batch order (without ``arrange``)."""
        per_rank = self.global_batch_size // self.dp_size
        return self.step_sample_ids()[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]

    def next_step(self) -> list[dict]:
        """This rank's micro-batches of the next global batch (dicts of tensors stacked on a new dim 0). With
        ``arrange``, every rank reads the whole global batch's lengths and documents (``attention_layout`` where
        the dataset has it: the tokens alone, not the whole sample), arranges it alike, micro-batches across all
        DP ranks, and reads the samples of its share: DP ranks are balanced against each other too."""
        if self.arrange is None:
            ids = self.rank_sample_ids()
        else:
            everyone = self.step_sample_ids()
            layout = getattr(self.dataset, "attention_layout", self.dataset.__getitem__)  # the cheap read if any
            order, per_rank = self.arrange([layout(i) for i in everyone]), self.global_batch_size // self.dp_size
            ids = [everyone[k] for k in order[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]]
        samples = [self.dataset[i] for i in ids]
        self._consumed += self.global_batch_size
        m = self.micro_batch_size
        return [collate(samples[k:k + m]) for k in range(0, len(samples), m)]

    def state_dict(self) -> dict:
        return {"consumed_samples": self._consumed}

    def load_state_dict(self, state: dict) -> None:
        self._consumed = int(state["consumed_samples"])


def collate(samples: list[dict]) -> dict:
    """Stack same-keyed sample tensors along a new batch dimension (``doc_offsets`` padded, see below)."""
    return {key: (pad_offsets if key == "doc_offsets" else torch.stack)([s[key] for s in samples])
            for key in samples[0]}


def pad_offsets(rows: list[torch.Tensor]) -> torch.Tensor:
    """[b, n_max + 1] from per-sample document offsets of different lengths: each row is padded by repeating
    its last offset (L), i.e. with empty documents, which attention skips."""
    width = max(row.numel() for row in rows)
    return torch.stack([torch.cat([row, row[-1:].expand(width - row.numel())]) for row in rows])
