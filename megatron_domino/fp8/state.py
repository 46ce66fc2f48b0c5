"""A model's FP8 scaling states together: the step-end update of delayed scaling, and checkpoints.

Delayed scaling records each operand's amax during the step (every micro-batch, μ-chunk and recomputed
forward). After the step, one all-reduce (MAX) over TP and one over data x context parallel carry every
linear's amaxes of this stage at once, so every rank that holds the stage, whatever the layout, derives the
same scales for the next step. The names are layout-free (checkpoints keep the histories under them:
``training/checkpoint.py``); an MoE layer's experts share one scaling ('experts.*'), their amax the max over
all experts, which keeps it independent of the expert-parallel layout.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist

from ..parallel import comm
from .scaling import LinearScaling

_EXPERT = re.compile(r"experts\.\d+\.")


def scalings(chunks) -> dict[str, LinearScaling]:
    """Every distinct scaling of these chunks by layout-free name, in module order."""
    found: dict[str, LinearScaling] = {}
    for chunk in chunks:
        for name, module in chunk.named_modules():
            scaling = getattr(module, "fp8", None)
            if isinstance(scaling, LinearScaling):
                key = _EXPERT.sub("experts.*.", chunk.global_name(name + ".weight"))[:-len(".weight")]
                found.setdefault(key, scaling)
    return found


def delayed_scalings(chunks) -> dict[str, LinearScaling]:
    """The scalings whose amax histories a checkpoint keeps (delayed scaling)."""
    return {name: s for name, s in scalings(chunks).items() if s.recipe.kind == "delayed"}


@torch.no_grad()
def end_step(chunks, groups=(), applied: bool = True) -> None:
    """Delayed scaling after a step: reduce the step's amaxes over ``groups`` (the stage's TP group, then its
    data x context parallel group) and roll them into the histories; a skipped step's amaxes (a non-finite
    loss's) are dropped."""
    delayed = list(delayed_scalings(chunks).values())
    if not delayed:
        return
    if not applied:
        for scaling in delayed:
            scaling.current.zero_()
        return
    amax = torch.stack([scaling.current for scaling in delayed])
    for group in groups:
        if comm.group_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    for scaling, reduced in zip(delayed, amax):
        scaling.roll_history(reduced)
