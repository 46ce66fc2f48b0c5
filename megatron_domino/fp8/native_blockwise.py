"""DeepSeek-V3's blockwise product in one cuBLAS call, in place of one GEMM per column of tiles.

Without it, ``quantize.scaled_mm`` multiplies tiled operands one 128-wide column of tiles at a time: K / 128
GEMMs, each writing and adding a whole fp32 output. On an H200 that made blockwise FP8 run at 0.09x of bf16.
cuBLAS (CUDA 12.9 and later, on Hopper) multiplies 1 x 128 tiles by 128 x 128 blocks, or by 1 x 128 tiles,
in one call that promotes to fp32 at every block of the contraction. ``torch._scaled_mm`` picks that kernel
from the scales' shapes and strides (ATen's ``is_blockwise_1x128_scaling`` and ``is_blockwise_128x128_scaling``):

- the first operand [M, K], 1 x 128 tiles: scales [M, K/128], M-major (strides (1, M));
- the second operand, given as mat2 = b^T of a row-major b [N, K]: the transpose of the scales that rule b's
  rows, so 128 x 128 blocks [N/128, K/128] row-major, or 1 x 128 tiles [N, K/128] N-major.

Whether this torch on this GPU does it is learnt once per device (``works``, fp8/probed_kernel.py): the four
kinds of product a linear makes, small, through the kernel and emulated; the kernel is used only when it runs and
agrees within 1e-3. A shape it refuses later falls back to the loop, with a warning, once per shape.
"""
from __future__ import annotations

import warnings

import torch

from .probed_kernel import ProbedKernel

BLOCK = 128
_refused: set[tuple] = set()


def native_scales(a_scale: torch.Tensor, b_scale: torch.Tensor, b_tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two operands' scales in cuBLAS's layouts, from ours (one row of tile scales per operand row)."""
    scale_a = a_scale.t().contiguous().t()
    if b_tile_rows == BLOCK:  # a weight's blocks: our rows repeat each block's scales 128 times
        return scale_a, b_scale[::BLOCK].contiguous().t()
    return scale_a, b_scale.t().contiguous()


def _kernel(a, b_t, scale_a, scale_b, out):
    return torch._scaled_mm(a, b_t, scale_a=scale_a, scale_b=scale_b, out_dtype=out.dtype, out=out)


def emulated(a, a_scale, b, b_scale) -> torch.Tensor:
    """a @ b^T from fp8 data and per-row tile scales, in fp64 (TF32 cannot touch it): what the kernel must match."""
    def dequantized(data, scale):
        return data.double() * scale.repeat_interleave(BLOCK, 1)[:, :data.shape[1]]
    return dequantized(a, a_scale) @ dequantized(b, b_scale).t()


def _probe(device: torch.device) -> bool:
    """Does the kernel run here and agree with the emulated product (within 1e-3, norm-wise)? Once per device."""
    gen = torch.Generator().manual_seed(0)
    m, n, k = 256, 384, 512

    def operand(rows, tile_rows, fmt):
        data = (torch.randn(rows, k, generator=gen) * 16).to(fmt)
        exponents = torch.randint(-4, 4, (-(-rows // tile_rows), k // BLOCK), generator=gen)
        scale = torch.exp2(exponents.float()).repeat_interleave(tile_rows, 0)[:rows]
        return data.to(device), scale.to(device)

    # the products a linear makes: x or a gradient (e4m3 or e5m2) by the weight's blocks or by x's tiles
    for a_format in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, a_scale = operand(m, 1, a_format)
        for tile_rows in (BLOCK, 1):
            b, b_scale = operand(n, tile_rows, torch.float8_e4m3fn)
            want = emulated(a, a_scale, b, b_scale).float()
            try:
                got = _kernel(a, b.t(), *native_scales(a_scale, b_scale, tile_rows), torch.empty_like(want))
            except RuntimeError:
                return False
            # Hopper's FP8 tensor cores accumulate a block in less than fp32; a wrong layout is off by O(1)
            if not bool(torch.linalg.vector_norm(got - want) <= 1e-3 * torch.linalg.vector_norm(want)):
                return False
    return True


KERNEL = ProbedKernel(_probe, "blockwise FP8: cuBLAS's blockwise kernel is missing or disagrees, so each product "
                              "runs one GEMM per 128-wide column of tiles (slow); CUDA 12.9+ on a Hopper GPU has "
                              "the kernel")
works = KERNEL.works


def product(a, a_scale, b, b_scale, b_tile_rows: int, out: torch.Tensor) -> torch.Tensor | None:
    """a @ b^T into ``out`` in one call (a in 1 x 128 tiles; b in 128 x 128 blocks or 1 x 128 tiles), or None
    where this device or shape cannot (the caller runs the loop)."""
    if a.shape[1] % BLOCK or not works(a.device):
        return None
    key = (tuple(a.shape), tuple(b.shape), b_tile_rows, a.dtype, b.dtype, out.dtype)
    if key in _refused:
        return None
    try:
        return _kernel(a, b.t(), *native_scales(a_scale, b_scale, b_tile_rows), out)
    except RuntimeError as error:
        _refused.add(key)
        warnings.warn(f"cuBLAS refused a blockwise FP8 product {key} ({error}); it runs tile by tile", stacklevel=2)
        return None
