"""Random number streams that make dropout correct under tensor parallelism.

Two streams exist. The *default* stream (torch's global generator) is identical on every TP
rank of a pipeline stage, for dropout on replicated activations. The *tensor-parallel* stream
differs per TP rank (and is identical across DP replicas), for dropout on split activations
such as attention probabilities of this rank's heads. ``fork()`` swaps a stream in and out.
Both states are captured for activation recompute and checkpoints; CPU and CUDA alike.
"""
from __future__ import annotations

import contextlib

import torch

from .device import cuda

TENSOR_PARALLEL_STREAM = "tensor-parallel"
_TP_SEED_OFFSET = 2718
_PIPELINE_SEED_STRIDE = 100


def _device_get_state(device: torch.device) -> torch.Tensor:
    return cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _device_set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Named generator states kept aside and swapped into the device's generator on demand.

    One per run (the trainer's), handed to the layers in their ``LayerContext`` and to the checkpointer:
    no layer looks a tracker up in process-wide state, so two models in one process keep their own."""

    def __init__(self, device: torch.device | None = None):
        self.device = device or torch.device("cpu")
        self.states: dict[str, torch.Tensor] = {}

    @classmethod
    def seeded(cls, seed: int, tp_rank: int = 0, pp_rank: int = 0, device: torch.device | None = None):
        """Seed the default stream (same across TP and DP) and return a tracker with the TP stream (distinct
        per TP rank). Pipeline stages get different default seeds so that their dropout masks are independent."""
        default_seed = seed + _PIPELINE_SEED_STRIDE * pp_rank
        tracker = cls(device)
        torch.manual_seed(default_seed)
        if device is not None and device.type == "cuda":
            cuda.manual_seed(default_seed)
        tracker.add(TENSOR_PARALLEL_STREAM, default_seed + _TP_SEED_OFFSET + tp_rank)
        return tracker

    def add(self, name: str, seed: int) -> None:
        saved = _device_get_state(self.device)
        self._seed_device(seed)
        self.states[name] = _device_get_state(self.device)
        _device_set_state(saved, self.device)

    def _seed_device(self, seed: int) -> None:
        if self.device.type == "cuda":
            cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_STREAM):
        """Run the block on stream ``name``; the default stream continues untouched afterwards."""
        if name not in self.states:
            raise KeyError(f"RNG stream {name!r} was never seeded: build the tracker with RNGTracker.seeded()")
        saved = _device_get_state(self.device)
        _device_set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _device_get_state(self.device)
            _device_set_state(saved, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def capture(self) -> dict:
        """Every stream's state, for a checkpoint: CPU, CUDA (when present) and the named streams."""
        state = {"cpu": torch.get_rng_state(), "tracker": self.get_states()}
        if self.device.type == "cuda":
            state["cuda"] = cuda.get_rng_state(self.device)
        return state

    def restore(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and self.device.type == "cuda":
            cuda.set_rng_state(state["cuda"], self.device)
        self.set_states(state["tracker"])
