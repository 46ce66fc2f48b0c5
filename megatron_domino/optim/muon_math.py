"""Muon's arithmetic on one whole matrix: the Newton-Schulz iteration, the update's scale, its cost, and which
logical matrices a fused weight holds.

Newton-Schulz is torch.optim.Muon's (Keller Jordan's quintic), operation for operation, so that one process
equals torch's optimizer bit for bit in bf16; ``dtype`` fp32 runs the same iteration in fp32, which the layout
parity tests need (bf16 would round the reductions' last-bit differences of the layouts into different updates).

A weight holds one matrix, or several fused ones: SwiGLU's gate and up (the TP spec's parts), MLA's down
projections (``ParamInfo.blocks``), and the group-major QKV (``ParamInfo.heads``), orthogonalized as Q, K and V
(``optimizer.muon_split_qkv``, Megatron's split_qkv) or as one.
"""
from __future__ import annotations

import math

import torch

EPS = 1e-7  # torch.optim.Muon's: the normalisation's floor
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def newton_schulz(matrix: torch.Tensor, steps: int, coefficients, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonalized ``matrix`` (U V^T of its SVD, approximately), in ``dtype``."""
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=EPS))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def scale(rows: int, cols: int, rule: str) -> float:
    """The update's factor for a rows x cols matrix: spectral sqrt(max(1, rows/cols)) (torch's "original"), or
    Moonlight's 0.2 sqrt(max(rows, cols)), which matches AdamW's update RMS (torch's "match_rms_adamw")."""
    if rule == "spectral":
        return math.sqrt(max(1, rows / cols))
    if rule == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"optimizer.muon_scale = {rule!r}: must be spectral or moonlight")


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """Multiply-adds x 2 of Newton-Schulz on a rows x cols matrix: per step X X^T (2 m^2 n), the Gram's square
    (2 m^3) and its product with X (2 m^2 n), with m the smaller side."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def _qkv_rows(heads: tuple[int, int, int]) -> list[torch.Tensor]:
    """The full QKV's row indices of Q, K and V (group-major: each group's queries, then its key, then its value)."""
    groups, queries, dim = heads
    rows = torch.arange(groups * (queries + 2) * dim).view(groups, queries + 2, dim)
    return [rows[:, :queries].reshape(-1), rows[:, queries].reshape(-1), rows[:, queries + 1].reshape(-1)]


def matrix_rows(info, full_shape, split_qkv: bool) -> tuple[int, list]:
    """(dim, pieces): the logical matrices of a full tensor, each a slice or an index tensor along ``dim``."""
    if info.heads is not None and split_qkv:
        return 0, _qkv_rows(info.heads)
    if info.blocks is not None:
        return 0, _slices(info.blocks)
    if info.spec is not None and len(info.spec.parts) > 1:
        return info.spec.dim, _slices(info.spec.parts)
    return 0, [slice(0, full_shape[0])]


def _slices(sizes) -> list[slice]:
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def split(full: torch.Tensor, layout: tuple[int, list]) -> list[torch.Tensor]:
    """The logical matrices of ``full`` (copies where they are not contiguous rows)."""
    dim, pieces = layout
    return [full.narrow(dim, p.start, p.stop - p.start) if isinstance(p, slice) else full.index_select(dim, p)
            for p in pieces]


def place(full: torch.Tensor, layout: tuple[int, list], matrices: list[torch.Tensor]) -> None:
    """The inverse of ``split``: write ``matrices`` into ``full``."""
    dim, pieces = layout
    for p, matrix in zip(pieces, matrices):
        if isinstance(p, slice):
            full.narrow(dim, p.start, p.stop - p.start).copy_(matrix)
        else:
            full.index_copy_(dim, p, matrix.to(full.dtype))


def shapes(full_shape, layout: tuple[int, list]) -> list[tuple[int, int]]:
    """The (rows, cols) of each logical matrix."""
    dim, pieces = layout
    sizes = [p.stop - p.start if isinstance(p, slice) else len(p) for p in pieces]
    return [(s, full_shape[1]) if dim == 0 else (full_shape[0], s) for s in sizes]
