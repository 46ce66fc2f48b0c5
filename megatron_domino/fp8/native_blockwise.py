"""DeepSeek-V3's blockwise product in one cuBLAS call, where this torch and GPU have it and read our scales right.

cuBLAS (CUDA 12.9 and later, on Hopper) multiplies 1 x 128 tiles by 128 x 128 blocks, or by 1 x 128 tiles, in one
call that promotes to fp32 at every block of the contraction. What it reads (L = K / 128 blocks of the contraction):

- the first operand [M, K], 1 x 128 tiles: scales [M, L], M-major (strides (1, M));
- the second operand b [N, K] (handed over as mat2 = b^T), 1 x 128 tiles: [N, L], N-major (strides (1, N));
- b in 128 x 128 blocks: [L4, N / 128] with column stride L4 = round_up(L, 4) (pytorch#166752).

torch's v2 scaled mm (``aten._scaled_mm_v2``, ``F.scaled_mm`` with ``ScalingType.BlockWise128x128``) takes the
blocks' scales only in that padded layout. The v1 ``torch._scaled_mm`` checks for stride L and passes the pointer
on, which cuBLAS reads with stride L4: right where L % 4 == 0, silently wrong elsewhere (K = 640, 1664, 5504 ...).
So the blocks go through v2 where torch has it; through v1 only where L % 4 == 0; otherwise, and wherever the
kernel is missing, ``quantize.scaled_mm`` multiplies the dequantised operands in one GEMM.

Whether a path works is learnt once per device (``KERNEL``, fp8/probed_kernel.py): the four kinds of product a
linear makes, at K = 512 (L = 4) and K = 640 (L = 5), through v2 and else v1, each kept only if every product it
takes agrees with an fp64 emulation within 1e-3 (Hopper's FP8 tensor cores accumulate a block in less than fp32;
a misread scale is off by O(1)). A shape the kernel refuses later falls back, with a warning, once per shape.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .probed_kernel import ProbedKernel

BLOCK = 128
_SCALING = getattr(F, "ScalingType", None)
PATHS = (("v2",) if hasattr(torch.ops.aten, "_scaled_mm_v2") and hasattr(_SCALING, "BlockWise128x128") else ()) + ("v1",)
_refused: set[tuple] = set()


def cublas_scales(a_scale, b_scale, b_tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both operands' scales as cuBLAS reads them (module docstring), from ours (a row of tile scales per row,
    rows-major; a weight's blocks repeat on each of their 128 rows). The blocks' layout is padded to L4 (v2's)
    and made once per scale tensor (a step's weight copy: once per step)."""
    scale_a = a_scale.t().contiguous().t()  # no copy: quantize_tiles makes them rows-major
    if b_tile_rows == 1:
        return scale_a, b_scale.t().contiguous().t()
    if getattr(b_scale, "cublas_blocks", None) is None:  # kept on the scale tensor, as long as it lives
        blocks = b_scale[::BLOCK]  # [N / 128, L]
        b_scale.cublas_blocks = F.pad(blocks, (0, -blocks.shape[1] % 4), value=1.0).contiguous().t()  # pad: unread
    return scale_a, b_scale.cublas_blocks


def takes(path: str, k: int, b_tile_rows: int) -> bool:
    """Whether ``path`` reads this product's scales as cuBLAS does (v1: blocks only where L % 4 == 0)."""
    return path == "v2" or b_tile_rows == 1 or (k // BLOCK) % 4 == 0


def _v1(a, b_t, scale_a, scale_b, out):
    return torch._scaled_mm(a, b_t, scale_a=scale_a, scale_b=scale_b, out_dtype=out.dtype, out=out)


def _v2(a, b_t, scale_a, recipe_b, scale_b, out):
    none = []  # no swizzle, no contraction dims (a row-major, b_t column-major)
    return torch.ops.aten._scaled_mm_v2.out(a, b_t, [scale_a], [_SCALING.BlockWise1x128.value], none, [scale_b],
                                            [recipe_b.value], none, None, out.dtype, none, False, out=out)


def _call(path, a, b, a_scale, b_scale, b_tile_rows, out):
    scale_a, scale_b = cublas_scales(a_scale, b_scale, b_tile_rows)
    if path == "v2":
        recipe_b = _SCALING.BlockWise1x128 if b_tile_rows == 1 else _SCALING.BlockWise128x128
        return _v2(a, b.t(), scale_a, recipe_b, scale_b, out)
    return _v1(a, b.t(), scale_a, scale_b.t() if b_tile_rows == 1 else scale_b, out)  # v1: 1x128 b as [L, N]


def emulated(a, a_scale, b, b_scale) -> torch.Tensor:
    """a @ b^T from fp8 data and per-row tile scales, in fp64 (TF32 cannot touch it): what the kernel must match."""
    def dequantized(data, scale):
        return data.double() * scale.double().repeat_interleave(BLOCK, 1)[:, :data.shape[1]]
    return dequantized(a, a_scale) @ dequantized(b, b_scale).t()


def _operand(rows, k, tile_rows, fmt, gen, device):
    data = (torch.randn(rows, k, generator=gen) * 16).to(fmt)
    exponents = torch.randint(-4, 4, (-(-rows // tile_rows), k // BLOCK), generator=gen)
    scale = torch.exp2(exponents.float()).repeat_interleave(tile_rows, 0)[:rows]
    return data.to(device), scale.to(device)


def agrees(path: str, device: torch.device) -> bool:
    """Does ``path`` run here and agree with the emulation on every product a linear makes that it takes?"""
    gen = torch.Generator().manual_seed(0)
    m, n = 256, 384  # three blocks of b's rows: a misread stride of the blocks' scales shows
    for k in (4 * BLOCK, 5 * BLOCK):
        for a_format in (torch.float8_e4m3fn, torch.float8_e5m2):  # x, or a gradient
            a, a_scale = _operand(m, k, 1, a_format, gen, device)
            for tile_rows in (BLOCK, 1):  # by the weight's blocks, or by x's tiles (the weight gradient)
                b, b_scale = _operand(n, k, tile_rows, torch.float8_e4m3fn, gen, device)
                if not takes(path, k, tile_rows):
                    continue
                want = emulated(a, a_scale, b, b_scale).float()
                try:
                    got = _call(path, a, b, a_scale, b_scale, tile_rows, torch.empty_like(want))
                except RuntimeError:
                    return False
                if not bool(torch.linalg.vector_norm(got - want) <= 1e-3 * torch.linalg.vector_norm(want)):
                    return False
    return True


def _probe(device: torch.device) -> str | bool:
    """The first path that agrees here (its name), else False."""
    return next((path for path in PATHS if agrees(path, device)), False)


KERNEL = ProbedKernel(_probe, "blockwise FP8: cuBLAS's blockwise kernel is missing or disagrees, so each product "
                              "multiplies the dequantised operands in the weights' dtype (slower than bf16); CUDA "
                              "12.9+ on a Hopper GPU has the kernel")


def product(a, a_scale, b, b_scale, b_tile_rows: int, out: torch.Tensor) -> torch.Tensor | None:
    """a @ b^T into ``out`` in one call (a in 1 x 128 tiles; b in 128 x 128 blocks or 1 x 128 tiles), or None
    where this device, torch or shape cannot (the caller multiplies the dequantised operands)."""
    if a.shape[1] % BLOCK or not KERNEL.works(a.device):
        return None
    path = KERNEL.verdict(a.device)
    path = PATHS[0] if path is True else path  # assumed (a rehearsal): the newest this torch has
    key = (tuple(a.shape), tuple(b.shape), b_tile_rows, a.dtype, b.dtype, out.dtype)
    if key in _refused:
        return None
    if not takes(path, a.shape[1], b_tile_rows):
        _refused.add(key)
        warnings.warn(f"blockwise FP8 {key}: torch {torch.__version__} has no v2 scaled mm, and v1 hands cuBLAS "
                      f"the blocks' scales in a layout it misreads where K / 128 is not a multiple of 4; this "
                      f"shape multiplies the dequantised operands", stacklevel=2)
        return None
    try:
        return _call(path, a, b, a_scale, b_scale, b_tile_rows, out)
    except RuntimeError as error:
        _refused.add(key)
        warnings.warn(f"cuBLAS refused a blockwise FP8 product {key} ({error}); it multiplies the dequantised "
                      f"operands", stacklevel=2)
        return None
