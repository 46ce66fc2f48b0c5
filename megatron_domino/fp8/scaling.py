"""Where one linear's FP8 scales come from, for the three operands of its three GEMMs.

y = x W^T (forward), dx = g W (input gradient), dW = g^T x (weight gradient): x and W in e4m3, g in
``model.fp8_grad_format``. The recipes (``model.fp8``):

- ``tensorwise`` (torchao's default): each operand's scale from its own current amax. An operand split across
  the TP ranks (a column-parallel weight and output gradient, a row-parallel weight and input) has its amax
  reduced with MAX over TP first, so every rank, and TP 1, quantises the same logical tensor alike. A Domino
  μ-chunk's activations and gradients get the chunk's own scale: waiting for every chunk would serialise Domino.
- ``delayed`` (Transformer Engine's classic): each scale from an amax history known before the step; the step's
  amaxes are recorded and reduced once per step (``fp8.state``), so nothing waits and every rank, μ-chunk and
  layout uses the same scale.
- ``blockwise`` (DeepSeek-V3's): x and g in 1 x B tiles along the contracted dimension, W in B x B blocks;
  tiles stay inside a TP split or μ-chunk (the config rules), so no amax crosses ranks.

Tensorwise and delayed quantise x and x^T in one pass in the forward (``quantize_pair``) and save x^T in FP8 for
the weight gradient, and g and g^T in one pass in the backward. The weight's FP8 copies (W for the forward, W^T
for the input gradient) and its tensorwise scale are made at its first use in a pipeline step and reused by every
micro-batch, μ-chunk and recomputed forward of the step (``step_weights``, ``fp8.weight_scales``), as Transformer
Engine keeps them; outside a step each use makes its own. Blockwise re-quantises the saved x (its tiles run along
another dimension in the weight gradient).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel import comm
from .quantize import (EAGER, FORMATS, Quantized, compiled_kernels, quantize_pair, quantize_tensorwise,
                       quantize_tiles, scale_from_amax, scaled_mm)

INPUT, WEIGHT, GRAD = 0, 1, 2  # the operands, as indexed in amax histories
FORWARD_FORMAT = "e4m3"


@dataclass(frozen=True)
class Fp8Recipe:
    kind: str  # tensorwise | delayed | blockwise
    grad_format: str = "e5m2"
    history_len: int = 16
    amax_compute: str = "max"
    margin: int = 0
    block: int = 128
    power_of_two: bool = True
    compiled: bool = False  # model.compile: the casts and amaxes as compiled kernels

    @classmethod
    def from_model(cls, m) -> "Fp8Recipe | None":
        if not m.fp8:
            return None
        return cls(m.fp8, m.fp8_grad_format, m.fp8_amax_history_len, m.fp8_amax_compute, m.fp8_margin,
                   m.fp8_block_size, m.fp8_power_of_two_scales, m.compile is True)

    def scale(self, amax: torch.Tensor, operand: int) -> torch.Tensor:
        return scale_from_amax(amax, self.dtype(operand), self.margin, self.power_of_two)

    def dtype(self, operand: int) -> torch.dtype:
        return FORMATS[self.grad_format if operand == GRAD else FORWARD_FORMAT]


class LinearScaling:
    """One linear's (or one MoE layer's experts') scaling state and its three FP8 GEMMs.

    ``split``: the operands whose tensor is split across the TP ranks of ``group``. Delayed scaling keeps
    ``history`` [history_len, 3] and the step's running amax ``current`` [3]."""

    def __init__(self, recipe: Fp8Recipe, split: tuple[int, ...], group, device=None):
        self.recipe, self.split, self.group = recipe, split, group
        self.weight_scales = None  # tensorwise: the block's step-long weight scales (``fp8.weight_scales``)
        self.step_weights: dict | None = None  # during a step: the weight's FP8 copies and scale, made once
        self.kernels = compiled_kernels() if recipe.compiled else EAGER
        # delayed scaling before its first history: the step multiplies in the weights' dtype and only records
        # amaxes (a host flag, the same on every rank), where a guessed scale (Transformer Engine's 1) would
        # flush small gradients to zero
        self.calibrating = recipe.kind == "delayed"
        if recipe.kind == "delayed":
            self.history = torch.zeros(recipe.history_len, 3, device=device)
            self.current = torch.zeros(3, device=device)
            self.scales = torch.ones(3, device=device)

    # --- scales -----------------------------------------------------------------------------------------------
    def amax(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s amax on this rank (0 for an empty piece), with this recipe's kernels."""
        return self.kernels.amax(x.detach()) if x.numel() else x.new_zeros((), dtype=torch.float32)

    def record(self, x: torch.Tensor, operand: int) -> None:
        """Delayed: fold ``x``'s amax into the step's running amax of ``operand`` (on the device, no sync)."""
        torch.maximum(self.current[operand], self.amax(x), out=self.current[operand])

    def scale(self, x: torch.Tensor, operand: int) -> torch.Tensor:
        """The per-tensor scale ``x`` is quantised with (tensorwise and delayed)."""
        if self.recipe.kind == "delayed":
            self.record(x, operand)
            return self.scales[operand]
        if operand == WEIGHT and self.weight_scales is not None:
            fixed = self.weight_scales.scale(self)
            if fixed is not None:
                return fixed
        r = self.recipe
        if x.numel() and not (operand in self.split and comm.group_size(self.group) > 1):
            return self.kernels.scale(x.detach(), r.dtype(operand), r.margin, r.power_of_two)  # amax and scale fused
        amax = self.amax(x)
        if operand in self.split and comm.group_size(self.group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        return r.scale(amax, operand)

    def roll_history(self, amax: torch.Tensor) -> None:
        """Delayed: append the step's reduced amax [3] to the history and derive the next step's scales."""
        self.history.copy_(torch.cat([amax[None].to(self.history), self.history[:-1]]))
        self.current.zero_()
        self.derive_scales()

    def derive_scales(self) -> None:
        """Delayed: the scales from the history (after a step, or a checkpoint's history loaded)."""
        self.calibrating = False
        latest = self.history.amax(0) if self.recipe.amax_compute == "max" else self.history[0]
        for operand in (INPUT, WEIGHT, GRAD):
            self.scales[operand] = self.recipe.scale(latest[operand], operand)

    # --- operands ---------------------------------------------------------------------------------------------
    def _tensorwise(self, x2d, operand, scale) -> Quantized:
        return quantize_tensorwise(x2d, scale, self.recipe.dtype(operand), self.kernels)

    def _tiles(self, x2d, operand, tile_rows: int = 1) -> Quantized:
        r = self.recipe
        return quantize_tiles(x2d, r.block, r.dtype(operand), r.margin, tile_rows, r.power_of_two, self.kernels)

    def _step_copy(self, key: tuple, weight: torch.Tensor, make):
        """``make()``, or during a step the value made at the first call for this weight (or piece of it). The
        entry holds the parameter, so no other tensor can take its id during the step."""
        if self.step_weights is None:
            return make()
        base = weight if weight._base is None else weight._base  # a Domino piece: a view of the parameter
        key = (*key, id(base), weight.storage_offset(), tuple(weight.shape), tuple(weight.stride()))
        if key not in self.step_weights:
            self.step_weights[key] = base, make()
        return self.step_weights[key][1]

    def weight_scale(self, weight) -> torch.Tensor:
        return self._step_copy(("scale",), weight, lambda: self.scale(weight, WEIGHT))

    def weight_operand(self, weight, scale=None, transposed: bool = False) -> Quantized:
        """W (or W^T, rows along the input features) quantised, once per step during a step."""
        def make():
            oriented = weight.t() if transposed else weight
            if self.recipe.kind == "blockwise":
                return self._tiles(oriented, WEIGHT, self.recipe.block)
            return self._tensorwise(oriented, WEIGHT, scale)
        return self._step_copy(("t" if transposed else "w",), weight, make)

    def forward_operands(self, x2d, weight, weight_scale=None) -> tuple[Quantized, Quantized, tuple, torch.Tensor]:
        """(x, W) quantised for y = x W^T, the scales the backward reuses, and what it keeps of x (x itself, or
        its FP8 transpose); ``weight_scale``: the whole weight's, when ``weight`` is a Domino piece of it
        (blockwise: pieces are whole blocks)."""
        if self.recipe.kind == "blockwise":
            return self._tiles(x2d, INPUT), self.weight_operand(weight), (), x2d
        sx = self.scale(x2d, INPUT)
        sw = self.weight_scale(weight) if weight_scale is None else weight_scale
        qx, qxt = quantize_pair(x2d, sx, self.recipe.dtype(INPUT), self.kernels)
        return qx, self.weight_operand(weight, sw), (sx, sw), qxt.data

    def whole_weight_scale(self, weight) -> torch.Tensor | None:
        """The scale every Domino piece of ``weight`` is quantised with (blockwise: each piece's own blocks)."""
        return None if self.recipe.kind == "blockwise" else self.weight_scale(weight)

    def grad_scale(self, g2d) -> torch.Tensor | None:
        return None if self.recipe.kind == "blockwise" else self.scale(g2d, GRAD)

    def grad_operands(self, g2d, gscale) -> tuple[Quantized, Quantized | None]:
        """(g along the output features, g^T along the tokens or None where blockwise tiles it apart)."""
        if self.recipe.kind == "blockwise":
            return self._tiles(g2d, GRAD), None
        return quantize_pair(g2d, gscale, self.recipe.dtype(GRAD), self.kernels)

    def weight_grad(self, g2d, x, scales, gscale, out_dtype=torch.float32, gt: Quantized | None = None):
        """dW = g^T x, contracted over the tokens (blockwise: tiles of B tokens); ``x``: the input, or its FP8
        transpose (``forward_operands``); ``gt``: g^T quantised already."""
        if self.recipe.kind == "blockwise":
            return scaled_mm(self._tiles(g2d.t(), GRAD), self._tiles(x.t(), INPUT), out_dtype)
        gt = self._tensorwise(g2d.t(), GRAD, gscale) if gt is None else gt
        if x.dtype in FORMATS.values():
            xt = Quantized(x, scales[0].float().reshape(()))
        else:
            xt = self._tensorwise(x.t(), INPUT, scales[0])
        return scaled_mm(gt, xt, out_dtype)
