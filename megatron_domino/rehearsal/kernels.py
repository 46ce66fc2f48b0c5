"""The kernels a CUDA build of torch picks, for fake ``cuda`` tensors on this CPU build.

Two composite functions choose their kernel by device in C++ code a CPU build does not have, and would
otherwise fall back to their decomposed reference, which saves more for backward than the GPU kernel:
- ``scaled_dot_product_attention``: CUDA's choice in priority order, flash, then memory-efficient, then
  math, each among the backends ``sdpa_kernel`` leaves enabled and only where the kernel takes the inputs
  (flash: fp16/bf16, equal head dims of at most 256 and a multiple of 8, no mask, grouped K/V heads as they
  are; memory-efficient: also fp32, K/V heads expanded to the query heads). Nothing usable raises the
  error CUDA raises ("No available kernel"), so a pinned kernel that cannot run fails here as on the GPU;
- ``rms_norm``: CUDA's fused kernel, which saves its input and the fp32 reciprocal RMS only.
Two ops have no fake kernel: ``torch._scaled_mm`` and v2's ``aten._scaled_mm_v2`` into ``out`` (FP8's GEMMs).
``scaled_mm_into`` runs each as the plain op, whose fake kernel checks what CUDA's does (dimensions of 16, row-
and column-major operands, the scales' shapes; v2 also the blocks' padded layout); the dispatch mode calls it,
since a torch-function mode is off inside ``autograd.backward``.
The FP8 kernels' probes cannot run on fake tensors: ``fp8_kernels_present`` answers them for the GPU rehearsed.
``model.compile``'s regions run their eager code (``compiled_regions_eager``): Dynamo does not trace under the
rehearsal's dispatch mode, and a region holds no collective and reads nothing on the host (``models/compiled.py``),
so the steps around the regions are checked as they run; their saved tensors are eager's, not the fused kernels'.
The math kernel and everything else run as the CPU build has them (the same ops CUDA runs).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..fp8 import grouped_kernel, native_blockwise
from ..models.compiled import Region

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def _flash_takes(q, k, v, attn_mask, enable_gqa: bool) -> bool:
    d = q.shape[-1]
    grouped_ok = k.shape[-3] == q.shape[-3] or (enable_gqa and q.shape[-3] % k.shape[-3] == 0)
    return (torch.backends.cuda.flash_sdp_enabled() and q.dtype in _HALF and attn_mask is None and q.dim() == 4
            and k.shape[-1] == d == v.shape[-1] and d <= 256 and d % 8 == 0 and grouped_ok)


def _efficient_takes(q, k, v, enable_gqa: bool) -> bool:
    align = 4 if q.dtype == torch.float32 else 8
    return (torch.backends.cuda.mem_efficient_sdp_enabled() and q.dim() == 4
            and (q.dtype in _HALF or q.dtype == torch.float32) and q.shape[-1] % align == 0
            and (k.shape[-3] == q.shape[-3] or enable_gqa))


def scaled_dot_product_attention(original, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    if _flash_takes(q, k, v, attn_mask, enable_gqa):
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if _efficient_takes(q, k, v, enable_gqa):
        if k.shape[-3] != q.shape[-3]:  # the kernel takes equal heads: K/V repeated per query head
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, q.requires_grad, dropout_p,
                                                            is_causal, scale=scale)[0]
    if torch.backends.cuda.math_sdp_enabled():
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)
    raise RuntimeError("No available kernel. Aborting execution. (rehearsal: the enabled SDPA backends take "
                       f"none of these inputs: {q.dtype}, head dim {q.shape[-1]}, mask {attn_mask is not None})")


@contextlib.contextmanager
def fp8_kernels_present(devices: int):
    """FP8's kernel probes (blockwise, grouped) multiply real numbers and read the verdict on the host, which fake
    tensors cannot answer: the rehearsed GPU, a Hopper, is taken to have both kernels, so their shapes are
    checked and their memory counted as the GPU would run them."""
    with contextlib.ExitStack() as stack:
        for kernel in (native_blockwise.KERNEL, grouped_kernel.KERNEL):
            stack.enter_context(kernel.assumed(True, [torch.device("cuda", index) for index in range(devices)]))
        yield


# FP8's GEMMs into a buffer (no fake kernel) -> the plain op (one)
SCALED_MM_INTO = {aten._scaled_mm.out: aten._scaled_mm.default}
if hasattr(aten, "_scaled_mm_v2"):
    SCALED_MM_INTO[aten._scaled_mm_v2.out] = aten._scaled_mm_v2.default


def scaled_mm_into(func, args, kwargs):
    """An op of ``SCALED_MM_INTO`` on fake tensors: the plain op, copied into ``out``."""
    kwargs = dict(kwargs)
    out = kwargs.pop("out")
    return out.copy_(SCALED_MM_INTO[func](*args, **kwargs))


class FusedRMSNorm(torch.autograd.Function):
    """CUDA's fused RMSNorm as far as memory goes: keeps the input and the fp32 reciprocal RMS."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.empty(x.shape[:-1] + (1,), dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), (torch.empty_like(weight) if weight is not None else None), None


class CudaKernels(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].device.type == "cuda":
            return scaled_dot_product_attention(func, *args, **kwargs)
        if func is F.rms_norm and args[0].device.type == "cuda":
            x, shape, weight, eps = (list(args) + [None, None])[:4]
            if len(shape) == 1:
                return FusedRMSNorm.apply(x, kwargs.get("weight", weight), kwargs.get("eps", eps))
        return func(*args, **kwargs)


@contextlib.contextmanager
def compiled_regions_eager():
    """Every ``model.compile`` region runs the function it compiles (see the module docstring)."""
    call = Region.__call__
    Region.__call__ = lambda region, *args: region.eager(*args)
    try:
        yield
    finally:
        Region.__call__ = call
