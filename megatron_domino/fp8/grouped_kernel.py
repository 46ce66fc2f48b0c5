"""CUDA's grouped FP8 GEMM for a rank's experts (``torch._scaled_grouped_mm``), where this torch and GPU have it.

One call multiplies every expert's rows by its weight: the first operand [n, K] row-major with one scale per row
(each expert's rows carry their expert's scale), the weights [E, K, N] column-major with one scale per column
(each expert's columns its expert's), groups ending at ``offs`` (int32, cumulative), a bf16 result. Torch has it
for e4m3 operands on Hopper (sm90) and later. Whether this torch on this GPU runs it and agrees with an fp64
emulation is learnt once per device (``works``, fp8/probed_kernel.py); a call it refuses later falls back to the
loop, with a warning, once per weight shape.
"""
from __future__ import annotations

import warnings

import torch

from .probed_kernel import ProbedKernel

E4M3 = getattr(torch, "float8_e4m3fn", None)
_refused: set[tuple] = set()


def _kernel(a, a_scales, b, b_scales, ends) -> torch.Tensor:
    """a [n, K] @ b[e]^T per group of rows, b [E, N, K] row-major (the rows of each expert's product)."""
    scale_b = b_scales.float()[:, None].expand(-1, b.shape[1]).contiguous()
    return torch._scaled_grouped_mm(a, b.transpose(-2, -1), a_scales.float().contiguous(), scale_b, offs=ends,
                                    out_dtype=torch.bfloat16)


def emulated(a, a_scales, b, b_scales, sizes: list[int]) -> torch.Tensor:
    """The same product in fp64 (what the kernel must match), each expert's ``sizes[e]`` rows in turn."""
    rows = (a.double() * a_scales[:, None].double()).split(sizes)
    return torch.cat([part @ (b[e].double() * b_scales[e].double()).t() for e, part in enumerate(rows)])


def _probe(device: torch.device) -> bool:
    """Does the kernel run here and agree with the emulation (within 1e-2 norm-wise: bf16 output)?"""
    gen = torch.Generator().manual_seed(0)
    sizes, k, n = (5, 19, 40, 16), 64, 48
    a = (torch.randn(sum(sizes), k, generator=gen) * 16).to(E4M3)
    b = (torch.randn(len(sizes), n, k, generator=gen) * 16).to(E4M3)
    b_scales = torch.exp2(torch.randint(-4, 4, (len(sizes),), generator=gen).float())
    a_scales = torch.exp2(torch.randint(-4, 4, (len(sizes),), generator=gen).float())
    a_scales = a_scales.repeat_interleave(torch.tensor(sizes))
    ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    want = emulated(a, a_scales, b, b_scales, list(sizes)).to(device)
    operands = [t.to(device) for t in (a, a_scales, b, b_scales, ends)]
    try:
        got = _kernel(*operands).double()
    except RuntimeError:
        return False
    return bool(torch.linalg.vector_norm(got - want) <= 1e-2 * torch.linalg.vector_norm(want))


KERNEL = ProbedKernel(_probe, "FP8 experts: the grouped FP8 GEMM is missing or disagrees, so each expert runs "
                              "its own GEMM")


def works(device: torch.device) -> bool:
    return hasattr(torch, "_scaled_grouped_mm") and KERNEL.works(device)


def takes(out_dtype: torch.dtype, device: torch.device, a_format, b_format) -> bool:
    """Whether the kernel serves this product: bf16 out, e4m3 both, a GPU where it works."""
    return out_dtype == torch.bfloat16 and a_format == E4M3 and b_format == E4M3 and works(device)


def product(a, a_scales, b, b_scales, ends) -> torch.Tensor | None:
    """Every expert's rows of ``a`` times its ``b[e]^T``: [n, N] bf16, or None where the kernel refuses these
    weights' shape (from then on: the rows' count changes every step)."""
    key = tuple(b.shape)
    if key in _refused:
        return None
    try:
        return _kernel(a, a_scales, b, b_scales, ends)
    except RuntimeError as error:
        _refused.add(key)
        warnings.warn(f"the grouped FP8 GEMM refused {key} ({error}); the experts run one GEMM each", stacklevel=2)
        return None
