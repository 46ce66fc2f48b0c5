"""cuBLASLt's blockwise FP8 GEMM on the CPU, reading the scales' memory as the real kernel does, behind torch's two
front doors and their checks: the stand-in that tests put in ``fp8/native_blockwise``'s place.

The kernel gets a pointer, not a tensor: it reads a's 1 x 128 tile scales at m + kb * M, b's 1 x 128 tile scales at
n + kb * N and b's 128 x 128 block scales at kb + nb * L4 with L4 = round_up(L, 4) (pytorch#166752), past the end
of the storage too (garbage there: NaN here). The fronts check what torch checks: v1 (``torch._scaled_mm``,
ATen's ``is_blockwise_*_scaling``) wants the blocks' scales with stride L, v2 (``aten._scaled_mm_v2``) with L4.
So a path that hands cuBLAS a layout it misreads gives wrong numbers here as on a GPU, and the product of a
right one equals the fp64 emulation (``native_blockwise.emulated``) rounded to the output dtype, exactly.
"""
from __future__ import annotations

import math

import torch

BLOCK = 128


def _read(scale: torch.Tensor, shape, strides) -> torch.Tensor:
    """What a kernel reading ``scale``'s memory from its first element with ``strides`` sees (NaN past the end)."""
    flat = torch.empty(0, dtype=scale.dtype).set_(scale.untyped_storage())[scale.storage_offset():]
    index = sum(torch.arange(n)[(...,) + (None,) * (len(shape) - 1 - d)] * s
                for d, (n, s) in enumerate(zip(shape, strides)))
    padded = torch.cat([flat, torch.full((int(index.max()) + 1,), float("nan"))])
    return padded[index]


def tile_reads(m: int, k: int, n: int, scale_a, scale_b, b_blocks: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales the kernel applies, per tile: a's [M, L] and b's [N / 128, L] (blocks) or [N, L] (tiles)."""
    tiles = math.ceil(k / BLOCK)
    a = _read(scale_a, (m, tiles), (1, m))
    if b_blocks:
        return a, _read(scale_b, (math.ceil(n / BLOCK), tiles), (-(-tiles // 4) * 4, 1))
    return a, _read(scale_b, (n, tiles), (1, n))


def cublas(a, b_t, scale_a, scale_b, b_blocks: bool, out):
    """The product as the kernel computes it from what it reads (in fp64, rounded once to ``out``'s dtype)."""
    b, (m, k) = b_t.t(), a.shape
    sa, sb = tile_reads(m, k, b.shape[0], scale_a, scale_b, b_blocks)
    if b_blocks:
        sb = sb.repeat_interleave(BLOCK, 0)[:b.shape[0]]
    sa, sb = (s.double().repeat_interleave(BLOCK, 1)[:, :k] for s in (sa, sb))
    return out.copy_((a.double() * sa) @ (b.double() * sb).t())


def _has(scale, shape, strides) -> bool:
    return tuple(scale.shape) == tuple(shape) and all(n == 1 or s == want
                                                      for n, s, want in zip(shape, scale.stride(), strides))


def v1_checks(a, b_t, scale_a, scale_b):
    """ATen's v1 checks; what cuBLAS then gets: (scale_a, scale_b, whether b's are blocks)."""
    (m, k), n = a.shape, b_t.shape[1]
    tiles = math.ceil(k / BLOCK)
    if not _has(scale_a, (m, tiles), (1, m)):
        raise RuntimeError("Invalid scaling configuration (scale_a)")
    rows = scale_b.t()  # ATen checks b's rows: mat2's transpose
    if _has(rows, (math.ceil(n / BLOCK), tiles), (tiles, 1)):
        return scale_a, scale_b, True
    if _has(rows, (n, tiles), (1, n)):
        return scale_a, rows, False
    raise RuntimeError("Invalid scaling configuration (scale_b)")


def v2_checks(a, b_t, scale_a, recipe_b, scale_b):
    """v2's checks (``_check_scaled_mm_sizes_v2``, ATen's ``check_deepseek_recipe``); what cuBLAS then gets."""
    (m, k), n = a.shape, b_t.shape[1]
    tiles = k // BLOCK
    blocks = recipe_b.name == "BlockWise128x128"
    want = ((-(-tiles // 4) * 4, math.ceil(n / BLOCK)), (1, -(-tiles // 4) * 4)) if blocks else ((n, tiles), (1, n))
    if not (_has(scale_a, (m, tiles), (1, m)) and _has(scale_b, *want)):
        raise RuntimeError(f"For 1x128 x {recipe_b.name} blockwise scaling, scale b must have shape {want}")
    return scale_a, scale_b, blocks


def fronts(calls: list, multiply=cublas):
    """(v1, v2): ``native_blockwise._v1`` and ``_v2`` as torch's checks and cuBLAS's reading make them; each call
    is listed in ``calls`` as (kind, a's shape, b's shape, what cuBLAS got)."""
    def run(a, b_t, got, out):
        calls.append(("128x128" if got[2] else "1x128", tuple(a.shape), tuple(b_t.t().shape), got))
        return multiply(a, b_t, *got, out)

    def v1(a, b_t, scale_a, scale_b, out):
        return run(a, b_t, v1_checks(a, b_t, scale_a, scale_b), out)

    def v2(a, b_t, scale_a, recipe_b, scale_b, out):
        return run(a, b_t, v2_checks(a, b_t, scale_a, recipe_b, scale_b), out)
    return v1, v2
