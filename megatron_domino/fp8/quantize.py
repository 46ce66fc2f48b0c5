"""FP8 operands and the scaled GEMM that multiplies them.

An operand is 2-D and its last dimension is the one the GEMM contracts. Its scale is what dequantises it
(value = fp8 number x scale, Transformer Engine's ``scale_inv``): one number for the whole tensor, or one per
row and per tile of ``block`` columns ([rows, cols / block]), which covers DeepSeek-V3's 1 x 128 activation
tiles and, repeated over a block's rows, its 128 x 128 weight blocks. Tiled operands go to cuBLAS's blockwise
kernel in one call where it exists and reads the scales right (``native_blockwise``); elsewhere they are
dequantised (each tile's numbers times its scale, in the output's 16-bit dtype or fp32) and multiplied in one
GEMM, which accumulates in fp32: with power-of-two scales the dequantised values are exact, so this is the
blockwise product of an fp32-accumulating kernel, on any build and device, and needs no FP8 GEMM at all (a
row-wise-scaled FP8 GEMM per tile column, the earlier loop, asked CUDA < 12.9 builds' CUTLASS kernel for an
fp32 output it refuses, and ran K / 128 GEMMs). Tensorwise operands go to ``torch._scaled_mm``. On the CPU,
torch's ``_scaled_mm`` upcasts the operands, scales them and multiplies in fp32, through a kernel 100 to 2,000
times slower than an fp32 GEMM (0.2 s for 256 x 64 x 192 on a 2-core Xeon); ``_product`` does those same steps
with ATen's fast ops, and a test holds it bit-equal to ``torch._scaled_mm``.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Callable

import torch

from . import native_blockwise

CUDA_MULTIPLE = 16  # cuBLAS's FP8 GEMM: the contraction and the second operand's columns in multiples of 16
FORMATS = {"e4m3": getattr(torch, "float8_e4m3fn", None), "e5m2": getattr(torch, "float8_e5m2", None)}


@dataclass
class Quantized:
    data: torch.Tensor  # float8, [rows, cols], row-major
    scale: torch.Tensor  # fp32 dequantisation multipliers: [] or [rows, cols / block]
    block: int = 0  # tile width along the columns; 0: one scale for the whole tensor
    tile_rows: int = 1  # rows of a tile (a weight's blocks: ``block``); its scales repeat on each of them

    def rows(self, index) -> "Quantized":
        """The operand restricted to some rows (a Domino piece of a weight: whole blocks)."""
        scale = self.scale if self.block == 0 else self.scale[index]
        return Quantized(self.data[index], scale, self.block, self.tile_rows)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0, power_of_two: bool = True) -> torch.Tensor:
    """The dequantisation scale that maps ``amax`` to the format's largest value (2^margin below it); an
    all-zero tensor gets scale 1. ``power_of_two`` rounds it up to one: dividing by it is exact, and an amax
    that differs in its last bits between two layouts (a sum in another order) gives the same scale, where an
    exact scale would move every element's rounding a little and flip some."""
    amax = amax.float()
    scale = amax / (torch.finfo(dtype).max / 2.0 ** margin)  # amax * 2^margin / max, rounded once
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return torch.where(amax > 0, scale, 1.0)


def _cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def _amax(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)  # one pass, no |x| written


def _amax_scale(x: torch.Tensor, dtype: torch.dtype, margin: int, power_of_two: bool) -> torch.Tensor:
    """x's scale from its amax: a reduction and its epilogue (compiled: one kernel)."""
    return scale_from_amax(_amax(x), dtype, margin, power_of_two)


def _cast_pair(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x and x^T (row-major both) cast with one scale: the backward's transposed operand made beside the
    forward's (compiled: one read of x)."""
    q = _cast(x, scale, dtype)
    return q, q.t().contiguous()


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` with zero rows and columns added up to multiples of ``rows`` and ``cols`` (zeros change no amax and
    add nothing to a product)."""
    pad_rows, pad_cols = -x.shape[0] % rows, -x.shape[1] % cols
    return torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows)) if pad_rows or pad_cols else x


def _tile_quantize(x: torch.Tensor, block: int, dtype: torch.dtype, margin: int, tile_rows: int,
                   power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the FP8 data [rows, cols], row-major; the scales [rows, cols / block], one row per data row, rows-major:
    the layout cuBLAS reads a 1 x 128 operand's in) of ``tile_rows`` x ``block`` tiles (compiled: one region)."""
    rows, cols = x.shape
    padded = _padded(x.float(), tile_rows, block)
    tiles = padded.reshape(padded.shape[0] // tile_rows, tile_rows, padded.shape[1] // block, block)
    scale = scale_from_amax(tiles.abs().amax(dim=(1, 3)), dtype, margin, power_of_two)
    data = _cast(tiles, scale[:, None, :, None], dtype).reshape(padded.shape)[:rows, :cols].contiguous()
    scale = scale if tile_rows == 1 else scale.repeat_interleave(tile_rows, 0)[:rows]
    return data, scale.t().contiguous().t()


@dataclass(frozen=True)
class Kernels:
    """The elementwise work of quantising: an amax, a scale from an amax, a cast, a cast to x and x^T, a tiled
    operand's scales and cast. ``model.compile`` fuses each into one kernel (``CompiledKernels``); eagerly each is a chain of
    ATen ops."""

    amax: Callable = _amax
    scale: Callable = _amax_scale
    cast: Callable = _cast
    cast_pair: Callable = _cast_pair
    tile_quantize: Callable = _tile_quantize


EAGER = Kernels()


def _own_copy(function: Callable) -> Callable:
    """``function`` with a code object of its own: dynamo keeps at most 8 graphs per code object."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


class CompiledKernels:
    """The same functions through torch.compile (dynamic shapes: every linear's differ), a compiled copy per FP8
    format, tile height and scale rank. Dynamo guards on each (and on the layout: rows or a transposed view; and
    the storage offset: 0 or a piece's), so one copy for all would pass its limit of 8 graphs. Inputs come
    detached: a Parameter, or requires_grad, would be a graph of its own too."""

    def __init__(self):
        self.copies: dict[tuple, tuple[Callable, Callable]] = {}  # key -> (the copy, its compiled form)

    def _compiled(self, function: Callable, *key) -> Callable:
        if (function, *key) not in self.copies:
            copy = _own_copy(function)
            self.copies[(function, *key)] = copy, torch.compile(copy, dynamic=True, fullgraph=True)
        return self.copies[(function, *key)][1]

    def amax(self, x):
        return self._compiled(_amax)(x)

    def scale(self, x, dtype, margin, power_of_two):
        return self._compiled(_amax_scale, dtype, margin, power_of_two)(x, dtype, margin, power_of_two)

    def cast_pair(self, x, scale, dtype):
        return self._compiled(_cast_pair, dtype)(x, scale, dtype)

    def cast(self, x, scale, dtype):  # a scale per tensor, or per row (the experts' one step: fp8/grouped.py)
        return self._compiled(_cast, dtype, scale.dim())(x, scale, dtype)

    def tile_quantize(self, x, block, dtype, margin, tile_rows, power_of_two):
        return self._compiled(_tile_quantize, dtype, tile_rows)(x, block, dtype, margin, tile_rows, power_of_two)


@functools.cache
def compiled_kernels() -> CompiledKernels:
    """One set per process."""
    return CompiledKernels()


def quantize_tensorwise(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, kernels: Kernels = EAGER
                        ) -> Quantized:
    return Quantized(kernels.cast(x.detach(), scale, dtype).contiguous(), scale.float().reshape(()))


def quantize_pair(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, kernels: Kernels = EAGER
                  ) -> tuple[Quantized, Quantized]:
    """x and x^T quantised with one scale, in one pass over x where compiled."""
    q, qt = kernels.cast_pair(x.detach(), scale, dtype)
    scale = scale.float().reshape(())
    return Quantized(q, scale), Quantized(qt, scale)


def quantize_tiles(x: torch.Tensor, block: int, dtype: torch.dtype, margin: int = 0, tile_rows: int = 1,
                   power_of_two: bool = True, kernels: Kernels = EAGER) -> Quantized:
    """Scales per ``tile_rows`` x ``block`` tile (1: DeepSeek's activation tiles; ``block``: its weight blocks),
    stored per row. ``x`` may be a transposed view: the FP8 data comes out row-major in one pass."""
    data, scale = kernels.tile_quantize(x.detach(), block, dtype, margin, tile_rows, power_of_two)
    return Quantized(data, scale, block, tile_rows)


def _fp8_padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``_padded`` for FP8 data, through its bytes (0 is +0.0 in both formats; not every torch pads float8)."""
    return _padded(x.view(torch.uint8), rows, cols).view(x.dtype)


def _cuda_product(a, b, scale_a, scale_b, out_dtype, out=None, bias=None) -> torch.Tensor:
    """``torch._scaled_mm`` as CUDA's kernel takes it: the contraction and b's columns in multiples of
    ``CUDA_MULTIPLE``, a row-major and b column-major. An expert's token count, which its weight gradient
    contracts, is rarely one: zeros pad the contraction (they add nothing) and b's columns (sliced off)."""
    pad_k, pad_n = -b.shape[0] % CUDA_MULTIPLE, -b.shape[1] % CUDA_MULTIPLE
    if not (pad_k or pad_n):
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype, out=out)
    columns = b.shape[1]
    a, b = _fp8_padded(a, 1, CUDA_MULTIPLE), _fp8_padded(b.t(), CUDA_MULTIPLE, CUDA_MULTIPLE).t()
    if scale_b.numel() > 1:  # row-wise: [1, columns]; the zero columns' scale is any finite number
        scale_b = torch.nn.functional.pad(scale_b, (0, pad_n), value=1.0)
    if bias is not None:
        bias = torch.nn.functional.pad(bias, (0, pad_n))
    product = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                               out=out if not pad_n else None)
    if pad_n:
        product = product[:, :columns]
        return product.contiguous() if out is None else out.copy_(product)
    return product


def _product(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             out_dtype: torch.dtype, out: torch.Tensor | None = None, bias: torch.Tensor | None = None
             ) -> torch.Tensor:
    """(a x scale_a) @ (b x scale_b) (+ bias) in fp32, rounded to ``out_dtype`` once (into ``out`` when given);
    ``b`` is [contraction, columns]; ``bias`` in ``out_dtype`` (16-bit: the GEMM's epilogue adds it)."""
    if a.is_cuda:
        return _cuda_product(a, b, scale_a, scale_b, out_dtype, out, bias)
    product = (a.float() * scale_a) @ (b.float() * scale_b)
    product = (product if bias is None else product.add_(bias.float())).to(out_dtype)
    return product if out is None else out.copy_(product)


def scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, out: torch.Tensor | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b^T (+ bias), [rows of a, rows of b], accumulated in fp32 (into ``out`` when given)."""
    shape = (a.data.shape[0], b.data.shape[0])
    if out is None:
        out = a.data.new_empty(shape, dtype=out_dtype)
    if 0 in (*shape, a.data.shape[1]):  # an expert without rows
        return out.zero_() if bias is None else out.copy_(bias.expand(shape))
    if a.block == 0 and b.block == 0 and (bias is None or bias.dtype == out.dtype != torch.float32):
        return _product(a.data, b.data.t(), a.scale, b.scale, out.dtype, out, bias)
    if bias is not None:  # fp32 out: no epilogue bias on CUDA
        return scaled_mm(a, b, out_dtype, out).add_(bias)
    if a.block != b.block:
        raise ValueError(f"FP8 operands tiled differently: {a.block} and {b.block} columns")
    if a.block == native_blockwise.BLOCK and a.tile_rows == 1:
        if native_blockwise.product(a.data, a.scale, b.data, b.scale, b.tile_rows, out) is not None:
            return out
    dtype = out.dtype if out.dtype in (torch.bfloat16, torch.float16) else torch.float32
    return torch.matmul(dequantized(a, dtype), dequantized(b, dtype).t(), out=out)


def dequantized(q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """A tiled operand's values in ``dtype``: each tile's FP8 numbers times its scale (exact for power-of-two
    scales in bf16 or fp32, whose exponents span FP8's)."""
    scale = q.scale.repeat_interleave(q.block, 1)[:, :q.data.shape[1]]
    return q.data.to(dtype) * scale.to(dtype)
