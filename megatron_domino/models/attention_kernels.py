"""Fused attention that also returns the log-sum-exp, and its backward: the pieces ring attention merges.

SDPA's public function returns only the output; ring attention needs each block's log-sum-exp to
merge blocks, and a backward that takes the merged output and log-sum-exp. torch exposes both
through its fused kernels' ops: on the CPU the flash kernel's CPU ops; on CUDA the flash kernel for 16-bit
inputs, and for fp32 the memory-efficient one (it pads its log-sum-exp to whole tiles of ``_CUDA_LSE_TILE`` rows,
so the padding is cut off here and restored for the backward). The memory-efficient backward is not used for
16-bit inputs: on an H200 (torch 2.11) its bf16 gradients were wrong by O(1) even for a dense query block and a
correct log-sum-exp (and by 1e36 with the kernel's own padded one), while fp32 was exact; the flash kernel's
equal SDPA's bit for bit (``tests/test_cuda.py``'s ring test, run by ``benchmarks/gpu_check.sh``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_CUDA_LSE_TILE = 32
_aten = torch.ops.aten


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where block results are merged: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """softmax(q kᵀ/√d) v for [b, heads, s, d] inputs with equal heads: (output, log-sum-exp [b, heads, s_q])."""
    if q.device.type == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse.to(accumulation_dtype(q.dtype))
    if _cuda_flash(q):
        out, lse = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
        return out, lse.float()
    out, lse = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[:2]
    return out, lse[..., :q.shape[2]].float()


def _cuda_flash(q: torch.Tensor) -> bool:
    """CUDA's flash kernel takes these heads: 16-bit, a head size that is a multiple of 8 up to 256."""
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def attention_backward(grad_out, q, k, v, out, lse, causal: bool):
    """(dq, dk, dv) of one block, given the output and log-sum-exp over *all* blocks the queries attend to.

    With the final output and log-sum-exp, each block's probabilities are its share of the full softmax,
    so the per-block gradients add up to the exact gradient.
    """
    grad_out, out = grad_out.contiguous(), out.contiguous()
    if q.device.type == "cpu":
        lse = lse.to(accumulation_dtype(q.dtype)).contiguous()
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal)
    no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: the kernels draw nothing
    if _cuda_flash(q):
        return _aten._scaled_dot_product_flash_attention_backward(  # None: no packed-sequence offsets
            grad_out, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, no_rng, no_rng)
    padded = -(-lse.shape[-1] // _CUDA_LSE_TILE) * _CUDA_LSE_TILE
    lse = F.pad(lse, (0, padded - lse.shape[-1])).contiguous()
    grads = _aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, None, out, lse, no_rng, no_rng, 0.0, [True, True, True, False], causal)
    return grads[:3]
