"""Activation recompute that replays dropout exactly, including the tensor-parallel RNG stream.

torch's checkpoint restores the global CPU/CUDA generators; the tracker's named streams are
restored here as well, so recomputed dropout masks equal the original ones.
"""
from __future__ import annotations

import contextlib

from torch.utils.checkpoint import checkpoint

from ..parallel.random import RNGTracker


def _tracker_contexts(tracker: RNGTracker):
    saved = tracker.get_states()

    @contextlib.contextmanager
    def replay():
        current = tracker.get_states()
        tracker.set_states(saved)
        try:
            yield
        finally:
            tracker.set_states(current)

    return contextlib.nullcontext(), replay()


def recompute(function, *args, rng: RNGTracker | None = None):
    """Run ``function(*args)`` keeping only its inputs; recompute it in backward with identical randomness
    (torch restores the default generators, ``_tracker_contexts`` the run's named streams in ``rng``)."""
    if rng is None:
        return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=lambda: _tracker_contexts(rng))
