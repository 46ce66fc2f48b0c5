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


def reads(a_shape, n: int, scale_a, scale_b, b_blocks: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-element scales the kernel applies: a's [M, K] and b's [N, K] (b given by its rows)."""
    (m, k), tiles = a_shape, math.ceil(a_shape[1] / BLOCK)
    a = _read(scale_a, (m, tiles), (1, m))
    if b_blocks:
        l4 = -(-tiles // 4) * 4
        b = _read(scale_b, (math.ceil(n / BLOCK), tiles), (l4, 1)).repeat_interleave(BLOCK, 0)[:n]
    else:
        b = _read(scale_b, (n, tiles), (1, n))
    return (a.repeat_interleave(BLOCK, 1)[:, :k], b.repeat_interleave(BLOCK, 1)[:, :k])


def cublas(a, b_t, scale_a, scale_b, b_blocks: bool, out, calls: list):
    b = b_t.t()
    sa, sb = reads(tuple(a.shape), b.shape[0], scale_a, scale_b, b_blocks)
    calls.append(("128x128" if b_blocks else "1x128", tuple(a.shape), tuple(b.shape)))
    return out.copy_((a.double() * sa.double()) @ (b.double() * sb.double()).t())


def _has(scale, shape, strides) -> bool:
    return tuple(scale.shape) == tuple(shape) and all(n == 1 or s == want
                                                      for n, s, want in zip(shape, scale.stride(), strides))


def fronts(calls: list):
    """(v1, v2): ``native_blockwise._v1`` and ``_v2`` as torch's checks and cuBLAS's reading make them."""
    def v1(a, b_t, scale_a, scale_b, out):
        (m, k), n = a.shape, b_t.shape[1]
        tiles = math.ceil(k / BLOCK)
        if not _has(scale_a, (m, tiles), (1, m)):
            raise RuntimeError("Invalid scaling configuration (scale_a)")
        rows = scale_b.t()  # ATen checks b's rows: mat2's transpose
        if _has(rows, (math.ceil(n / BLOCK), tiles), (tiles, 1)):
            return cublas(a, b_t, scale_a, scale_b, True, out, calls)
        if _has(rows, (n, tiles), (1, n)):
            return cublas(a, b_t, scale_a, rows, False, out, calls)
        raise RuntimeError("Invalid scaling configuration (scale_b)")

    def v2(a, b_t, scale_a, recipe_b, scale_b, out):
        (m, k), n = a.shape, b_t.shape[1]
        tiles = k // BLOCK
        l4 = -(-tiles // 4) * 4
        blocks = recipe_b.name == "BlockWise128x128"
        want = ((l4, math.ceil(n / BLOCK)), (1, l4)) if blocks else ((n, tiles), (1, n))
        if not (_has(scale_a, (m, tiles), (1, m)) and _has(scale_b, *want)):
            raise RuntimeError(f"For 1x128 x {recipe_b.name} blockwise scaling, scale b must have shape {want}")
        return cublas(a, b_t, scale_a, scale_b, blocks, out, calls)
    return v1, v2
