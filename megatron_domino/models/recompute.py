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
