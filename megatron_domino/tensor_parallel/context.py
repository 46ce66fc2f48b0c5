"""Where a model's layers run (``LayerContext``), as one value passed to every layer's constructor.

The TP group, whether activations are split along the sequence between TP regions (sequence
parallelism), how Domino reduces input gradients, the parameters' dtype and device, the context-parallel
ring (attention and the positions use it) and the expert-parallel group (the MoE token exchange) used to
travel as separate arguments through every model constructor. A ``LayerContext`` carries them together,
explicitly: no layer looks anything up in process-wide state.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..parallel import comm
from ..parallel.random import RNGTracker


@dataclass(frozen=True)
class LayerContext:
    group: object = None  # the TP process group; None: one rank
    sequence_parallel: bool = False  # normalised: never on with one TP rank
    grad_pieces: int = 0  # Domino: column pieces of the async input-gradient all-reduce; 0 = synchronous
    dtype: torch.dtype = torch.float32
    device: torch.device | None = None
    cp_group: object = None  # the context-parallel ring (ring attention); None: one rank
    cp_comm: str = "ring"  # how attention spans the CP ranks: "ring", "a2a" (Ulysses, models/ulysses.py), "a2a+ring"
    cp_a2a_group: object = None  # a2a+ring: this rank's all-to-all group (consecutive CP ranks) ...
    cp_ring_group: object = None  # ... and its ring across the groups
    cp_a2a_slices: int = 1  # a2a: head slices pipelined (``models.ulysses.ulysses_attention``)
    ep_group: object = None  # the ranks sharing the experts out (MoE token exchange); None: one rank
    balance_group: object = None  # the dp x cp ranks of the global balance loss (``models.balance``)
    experts_split: bool = True  # experts split over TP like the MLP; False: whole, shared out over tp x ep
    rng: RNGTracker | None = None  # the run's dropout streams; None: one TP rank's default stream serves
    fp8: object = None  # an ``fp8.scaling.Fp8Recipe``: attention's and the MLP's linears multiply in FP8
    turns: object = None  # the run's ``parallel.turns.TurnTaking``: its waits hand over inside an F&B unit

    def __post_init__(self):
        object.__setattr__(self, "sequence_parallel", bool(self.sequence_parallel) and self.size > 1)

    @property
    def size(self) -> int:
        return comm.group_size(self.group)

    @property
    def rank(self) -> int:
        return comm.group_rank(self.group)

    @property
    def cp_size(self) -> int:
        return comm.group_size(self.cp_group)

    @property
    def cp_rank(self) -> int:
        """Rank in the ring, which is the cp coordinate (ring members are created in cp order)."""
        return comm.group_rank(self.cp_group)

    @property
    def cp_a2a(self) -> int:
        """CP ranks per all-to-all group of a2a+ring (their tokens lie as ``ring_attention.local_positions`` says);
        1 otherwise."""
        return comm.group_size(self.cp_a2a_group) if self.cp_comm == "a2a+ring" else 1

    def tp_stream(self):
        """A context drawing dropout from this TP rank's stream (activations that differ per TP rank)."""
        if self.rng is not None:
            return self.rng.fork()
        if self.size > 1:
            raise RuntimeError("dropout on tensor-parallel activations needs the run's RNG streams: build the "
                               "LayerContext with rng=RNGTracker.seeded(seed, tp_rank, pp_rank)")
        return contextlib.nullcontext()
