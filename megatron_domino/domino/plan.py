"""Which Domino strategy a run uses, resolved once from the config.

Row split: the micro batch is cut into ``chunks`` mu-batches whose all-reduces overlap each
other's compute. Column split: a row-parallel weight is cut into ``chunks`` column pieces,
each reduced while the next is computed (no narrowing of the batch). 2-D: both.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from ..config.checks import Checks
from ..config.schema import DOMINO_OVERLAPS as OVERLAPS
from ..config.schema import DOMINO_SPLITS as SPLITS

ROW_SPLIT_WARNING = ("parallel.domino_split=row needs train.micro_batch_size >= 2; "
                     "micro batch 1 runs the column split instead")


def check_domino(c: Checks, enabled: bool, chunks: int, split: str, overlap: str,
                 micro_batch_size: int | None = None) -> None:
    """The rules of ``parallel.domino_*``, for ``DominoPlan`` and ``validate_config`` alike; with the micro
    batch known, the warning that a row split of one sample runs the column split."""
    c.positive("parallel.domino_chunks", chunks)
    c.one_of("parallel.domino_split", split, SPLITS)
    c.one_of("parallel.domino_overlap", overlap, OVERLAPS)
    if enabled and split == "row" and micro_batch_size is not None and micro_batch_size < 2:
        c.warnings.append(ROW_SPLIT_WARNING)


@dataclass(frozen=True)
class DominoPlan:
    enabled: bool = False
    chunks: int = 2
    split: str = "row"  # row | column | 2d
    overlap: str = "inter"  # intra | inter
    attention_apart: bool = False  # parallel.cp_a2a_output_overlap: Ulysses' attention core is a phase of its own

    @classmethod
    def from_config(cls, parallel) -> "DominoPlan":
        return cls(parallel.domino, parallel.domino_chunks, parallel.domino_split, parallel.domino_overlap,
                   parallel.cp_a2a_output_overlap)

    def __post_init__(self):
        c = Checks()
        check_domino(c, self.enabled, self.chunks, self.split, self.overlap)
        c.raise_problems()

    @property
    def grad_pieces(self) -> int:
        """Column pieces of each column-parallel input-gradient all-reduce; 0 = synchronous Megatron path."""
        if not self.enabled:
            return 0
        return self.chunks if self.split in ("column", "2d") else 1

    def split_for(self, batch_size: int) -> tuple[int, int]:
        """(batch chunks, column pieces) for a micro batch of ``batch_size`` samples.

        A batch split needs at least 2 samples: with micro batch 1 the row split runs the column
        split instead (one warning), so micro batch 1 still overlaps and never crashes.
        """
        if not self.enabled:
            return 1, 1
        rows = min(self.chunks, batch_size) if self.split in ("row", "2d") else 1
        columns = self.chunks if self.split in ("column", "2d") else 1
        if self.split == "row" and rows < 2:
            # once per calling line, by Python's own warning registry
            warnings.warn("Domino: micro batch 1 cannot be split by rows; using the column split for it", stacklevel=2)
            columns = self.chunks
        return rows, columns

    def overrides(self) -> list[str]:
        """The config overrides that select this plan."""
        return [f"parallel.domino={str(self.enabled).lower()}", f"parallel.domino_chunks={self.chunks}",
                f"parallel.domino_split={self.split}", f"parallel.domino_overlap={self.overlap}",
                f"parallel.cp_a2a_output_overlap={str(self.attention_apart).lower()}"]


# The modes that tests and benchmarks compare: synchronous TP, then each Domino split and overlap.
COMPARED_PLANS = {
    "sync": DominoPlan(enabled=False),
    "row-intra": DominoPlan(True, 2, "row", "intra"),
    "row-inter": DominoPlan(True, 2, "row", "inter"),
    "column": DominoPlan(True, 2, "column", "intra"),
    "2d": DominoPlan(True, 2, "2d", "inter"),
}
