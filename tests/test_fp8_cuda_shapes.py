"""FP8 GEMMs in the shapes CUDA's ``torch._scaled_mm`` takes: the contraction and the second operand's columns in
multiples of 16. An expert's token count, which its weight gradient contracts, rarely is one; without padding, every
FP8 MoE run on a GPU stopped in its first backward, while the CPU's kernel, which has no such rule, took it.

1. On the fake CUDA device, torch's own checks of the CUDA kernel (its fake kernel) see every product of an FP8
   linear on 7 and 130 tokens, 40 output features, for each recipe.
2. On the CPU, a tiny Mixtral trained in FP8 tensorwise through the CUDA path, with a stand-in that enforces CUDA's
   rules and then multiplies as the CPU does, equals the CPU path bit for bit, and the stand-in saw unaligned
   products. Blockwise without cuBLAS's blockwise kernel multiplies dequantised operands: it trains the same with a
   ``torch._scaled_mm`` that refuses everything (a build whose FP8 GEMMs refuse what it would ask).
"""
import pytest
import torch

from megatron_domino.fp8 import quantize
from tests.fake_cuda import on_fake_cuda
from tests.test_context_parallel import MIXTURE, _reference
from tests.test_fp8_parity import fp8

pytestmark = pytest.mark.quick


def _linears_on_fake_cuda():
    """Forward and backward of an FP8 linear per recipe and token count, on fake CUDA tensors."""
    import torch

    from megatron_domino.fp8 import native_blockwise
    from megatron_domino.fp8.linear import linear
    from megatron_domino.fp8.scaling import Fp8Recipe, LinearScaling
    from tests.fake_cuda import fake_fp8_modes
    shapes = []
    # the probe reads values: fake tensors have none
    with fake_fp8_modes(), native_blockwise.KERNEL.assumed(True, [torch.device("cuda", 0)]):
        for kind in ("tensorwise", "delayed", "blockwise"):
            for tokens in (7, 130):
                scaling = LinearScaling(Fp8Recipe(kind), (), None, device="cuda")
                scaling.calibrating = False  # delayed: scales from a history (ones here), not the calibration step
                x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                w = torch.randn(40, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                y = linear(x, w, None, scaling)
                y.backward(torch.ones_like(y))
                shapes.append([kind, list(y.shape), list(x.grad.shape), list(w.grad.shape)])
    return shapes


def test_every_fp8_product_meets_cudas_shape_rules_on_the_fake_device():
    shapes = on_fake_cuda("tests.test_fp8_cuda_shapes:_linears_on_fake_cuda")
    assert shapes == [[kind, [tokens, 40], [tokens, 256], [40, 256]]
                      for kind in ("tensorwise", "delayed", "blockwise") for tokens in (7, 130)]


def _cuda_rules(original, seen):
    """``torch._scaled_mm`` refusing what CUDA's refuses, else the CPU's; records whether padding was needed."""
    def scaled_mm(a, b, *, scale_a, scale_b, out_dtype, out=None, bias=None):
        if a.shape[1] % 16 or b.shape[0] % 16 or b.shape[1] % 16:
            raise RuntimeError(f"CUDA's FP8 GEMM takes dimensions of 16: {tuple(a.shape)} x {tuple(b.shape)}")
        if a.stride(1) != 1 or b.stride(0) != 1:
            raise RuntimeError("CUDA's FP8 GEMM takes a row-major and b column-major")
        return original(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, out=out, bias=bias)

    def recorded(a, b, scale_a, scale_b, out_dtype, out=None, bias=None):
        seen.append(b.shape[0] % 16 != 0 or b.shape[1] % 16 != 0)
        return quantize._cuda_product(a, b, scale_a, scale_b, out_dtype, out, bias)
    return scaled_mm, recorded


@pytest.mark.parametrize("kind", ["tensorwise", "blockwise"])
def test_fp8_experts_through_the_cuda_path_equal_the_cpu_path_bit_for_bit(monkeypatch, kind):
    model = fp8(MIXTURE, kind)
    want_losses, want_weights = _reference(model, False)
    seen = []
    scaled_mm, recorded = _cuda_rules(torch._scaled_mm, seen)
    if kind == "blockwise":
        def scaled_mm(*args, **kwargs):
            raise RuntimeError("this build's FP8 GEMM refuses it")
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(quantize, "_product", recorded)
    losses, weights = _reference(model, False)
    # tensorwise: some products were unaligned (experts' token counts); blockwise: no FP8 GEMM at all
    assert any(seen) if kind == "tensorwise" else seen == []
    assert losses == want_losses
    for name, weight in weights.items():
        assert torch.equal(weight, want_weights[name]), name
