"""During a pipeline step the weights do not change: each FP8 linear's weight copies (W and W^T, and at tp 1 its
tensorwise scale) are made once per step (``LinearScaling.step_weights``), and tensorwise weight scales of TP-split
weights come from one all-reduce per block and step, instead of one per weight and use.

The copies cost a byte per weight element each, held for the step (Transformer Engine keeps the same); they are
kept only for linears with a weight of their own (not routed experts, which share a scaling) and not under
ZeRO-3, whose gathered weights are released within the step and whose buffers another layer reuses.

A tensor-parallel weight's tensorwise scale needs its amax reduced with MAX over TP (``scaling``). Asked for
at every use, that is one small all-reduce per linear, Domino μ-chunk, micro-batch and recomputed forward, each
on the critical path of its GEMM. During a pipeline step (``fixed_for_the_step``, which the trainer holds around
the engine's run) the weights do not change, so the first weight-scale request of a block reads every TP-split
FP8 weight of the block (attention's, MLA's, the dense MLP's and the shared experts'), reduces their amaxes in
one all-reduce, and every later use in the step takes its scale from there: the same scales, bit for bit, as
asking each time (MAX is exact). Outside a step (a model called directly) each use reduces its own, as before.
Routed experts share one scaling for all their weights and keep the per-use reduction. NCCL: the first request
comes from the same linear of the same block on every TP rank, since they run the same program.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..parallel import comm
from .scaling import WEIGHT, LinearScaling


class BlockWeightScales:
    """The tensorwise weight scales of one block's TP-split FP8 linears (``members``: (scaling, module))."""

    def __init__(self, members: list[tuple[LinearScaling, torch.nn.Module]], group):
        self.members, self.group = members, group
        self.scales: dict[int, torch.Tensor] | None = None  # id(scaling) -> its weight's scale, this step
        self.active = False

    def scale(self, scaling: LinearScaling) -> torch.Tensor | None:
        """The weight's scale of ``scaling`` for this step; None outside a step (the caller reduces its own)."""
        if not self.active:
            return None
        if self.scales is None:
            amaxes = torch.stack([member.amax(module.weight) for member, module in self.members])
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=self.group)
            self.scales = {id(member): member.recipe.scale(amax, WEIGHT)
                           for (member, _), amax in zip(self.members, amaxes)}
        return self.scales[id(scaling)]


def _block_members(block) -> list[tuple[LinearScaling, torch.nn.Module]]:
    """The block's linears with a scaling of their own whose tensorwise weight scale is reduced over TP."""
    members, owners = [], {}
    for module in block.modules():
        scaling = getattr(module, "fp8", None)
        if isinstance(scaling, LinearScaling):
            owners.setdefault(id(scaling), []).append((scaling, module))
    for shared in owners.values():
        scaling, module = shared[0]
        if (len(shared) == 1 and scaling.recipe.kind == "tensorwise" and WEIGHT in scaling.split
                and comm.group_size(scaling.group) > 1):
            members.append((scaling, module))
    return members


def _groups(chunk) -> list[BlockWeightScales]:
    """The chunk's blocks' weight-scale groups, made at the first step and attached to their scalings."""
    if not hasattr(chunk, "_fp8_weight_scales"):
        chunk._fp8_weight_scales = []
        for block in chunk.blocks():
            members = _block_members(block)
            if members:
                group = BlockWeightScales(members, members[0][0].group)
                for scaling, _ in members:
                    scaling.weight_scales = group
                chunk._fp8_weight_scales.append(group)
    return chunk._fp8_weight_scales


def _own_weight_scalings(chunks) -> list[LinearScaling]:
    """The FP8 scalings that serve one module each (a routed expert's is shared by the layer's experts)."""
    owners: dict[int, list] = {}
    for chunk in chunks:
        for module in chunk.modules():
            scaling = getattr(module, "fp8", None)
            if isinstance(scaling, LinearScaling):
                owners.setdefault(id(scaling), []).append(scaling)
    return [shared[0] for shared in owners.values() if len(shared) == 1]


@contextlib.contextmanager
def fixed_for_the_step(chunks, keep_copies: bool = True):
    """Within: the weights stay as they are, so each block's weight scales are reduced once and reused, and
    (``keep_copies``: not under ZeRO-3) each linear's FP8 weight copies are made once and reused."""
    groups = [group for chunk in chunks for group in _groups(chunk)]
    scalings = _own_weight_scalings(chunks) if keep_copies else []
    for group in groups:
        group.active, group.scales = True, None
    for scaling in scalings:
        scaling.step_weights = {}
    try:
        yield
    finally:
        for group in groups:
            group.active, group.scales = False, None
        for scaling in scalings:
            scaling.step_weights = None
