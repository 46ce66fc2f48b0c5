"""Activation recompute that replays dropout exactly, including the tensor-parallel RNG stream, applied to a
model from outside (``apply_recompute``): the layers only name where recompute may cut (their runners).

torch's checkpoint restores the global CPU/CUDA generators; the tracker's named streams are
restored here as well, so recomputed dropout masks equal the original ones.
"""
from __future__ import annotations

import contextlib
import functools

from torch.utils.checkpoint import checkpoint

from ..parallel.random import RNGTracker


class _Replay:
    """The tracker's streams as they were at the forward, for the span of a recompute. Entered once per recompute,
    and a split backward (its I, then its W: pipeline/split_backward.py) recomputes a phase twice, so it is a
    class: a generator's context manager cannot be entered a second time."""

    def __init__(self, tracker: RNGTracker):
        self.tracker, self.saved, self.current = tracker, tracker.get_states(), None

    def __enter__(self):
        self.current = self.tracker.get_states()
        self.tracker.set_states(self.saved)

    def __exit__(self, *exc):
        self.tracker.set_states(self.current)


def _tracker_contexts(tracker: RNGTracker):
    return contextlib.nullcontext(), _Replay(tracker)


def recompute(function, *args, rng: RNGTracker | None = None):
    """Run ``function(*args)`` keeping only its inputs; recompute it in backward with identical randomness
    (torch restores the default generators, ``_tracker_contexts`` the run's named streams in ``rng``)."""
    if rng is None:
        return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=lambda: _tracker_contexts(rng))


def run(function, *args):
    """The plain runner: compute now, keep what autograd keeps."""
    return function(*args)


def apply_recompute(chunk, mode: str, rng: RNGTracker | None = None) -> None:
    """``model.recompute`` on a model chunk: "full" recomputes each block phase up to its row-parallel
    projection in backward (``TransformerBlock.run_phase``: no communication is repeated, so Domino's
    overlap is untouched), "selective" only the attention core (``Attention.run_core``), "none" nothing."""
    runner = functools.partial(recompute, rng=rng)
    for block in chunk.blocks():
        block.run_phase = runner if mode == "full" else run
        block.attention.run_core = runner if mode == "selective" else run
