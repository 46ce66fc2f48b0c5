"""Blockwise FP8 through cuBLAS's one-call kernel (``fp8/native_blockwise.py``), checked on the CPU.

The kernel runs only on a Hopper GPU (``tests/test_cuda.py`` compares it there). Here a stand-in takes its
place: it accepts the scales only in the layouts ATen's ``is_blockwise_1x128_scaling`` and
``is_blockwise_128x128_scaling`` recognise (anything else raises, as torch does) and multiplies tile by tile as
the loop does. So a linear's forward and both backward products through it equal the loop bit for bit only if
every operand's scales reach the kernel in the layout and order cuBLAS reads them.
"""
import math
import warnings

import pytest
import torch

from megatron_domino.fp8 import native_blockwise
from megatron_domino.fp8.linear import linear
from megatron_domino.fp8.scaling import Fp8Recipe, LinearScaling
from megatron_domino.tensor_parallel.async_comm import column_linear_async, row_linear_launch

pytestmark = pytest.mark.quick
BLOCK = native_blockwise.BLOCK


def _layout(scale, shape, strides) -> bool:
    return tuple(scale.shape) == shape and all(n == 1 or s == want for n, s, want in
                                                zip(shape, scale.stride(), strides))


def _standin(calls):
    def kernel(a, b_t, scale_a, scale_b, out):
        """cuBLAS's blockwise product on the CPU, reading the scales as ATen's checks lay them out."""
        b = b_t.t()  # ATen checks mat2's transpose (the rows of b) against scale_b's transpose
        (m, k), n = a.shape, b.shape[0]
        tiles = math.ceil(k / BLOCK)
        if not _layout(scale_a, (m, tiles), (1, m)):
            raise RuntimeError(f"scale_a {tuple(scale_a.shape)} {scale_a.stride()} is not 1x128")
        rows = scale_b.t()
        if _layout(rows, (math.ceil(n / BLOCK), tiles), (tiles, 1)):
            rows, kind = rows.repeat_interleave(BLOCK, 0)[:n], "128x128"
        elif _layout(rows, (n, tiles), (1, n)):
            kind = "1x128"
        else:
            raise RuntimeError(f"scale_b {tuple(scale_b.shape)} {scale_b.stride()} is neither 1x128 nor 128x128")
        calls.append(kind)
        total = None
        for tile in range(tiles):
            cols = slice(tile * BLOCK, (tile + 1) * BLOCK)
            part = (a[:, cols].float() * scale_a[:, tile:tile + 1]) @ (b[:, cols].float() * rows[:, tile:tile + 1]).t()
            total = part if total is None else total.add_(part)
        return out.copy_(total)
    return kernel


@pytest.fixture
def native(monkeypatch):
    """The stand-in in the kernel's place; ``native.on`` says whether the CPU takes the one-call path."""
    class Native:
        calls, on = [], True
    monkeypatch.setattr(native_blockwise, "_kernel", _standin(Native.calls))
    monkeypatch.setattr(native_blockwise, "works", lambda device: Native.on)
    monkeypatch.setattr(native_blockwise, "_refused", set())
    return Native


def _operands(tokens=256, k=384, n=256):
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(tokens, k, generator=gen) * 3, torch.randn(n, k, generator=gen) * 0.05,
            torch.randn(tokens, n, generator=gen) * 1e-3)


def _run(product, x, w, g):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = product(x, w)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def _products():
    def scaling():
        return LinearScaling(Fp8Recipe("blockwise", block=BLOCK), (), None)
    return {
        "plain": lambda x, w: linear(x, w, None, scaling()),
        "domino column (2 input-gradient pieces)": lambda x, w: column_linear_async(x, w, None, None, 2, fp8=scaling()),
        "domino row (2 output pieces)": lambda x, w: row_linear_launch(x, w, None, 2, fp8=scaling()).wait(),
    }


def test_one_call_products_equal_the_tile_loop_bit_for_bit(native):
    x, w, g = _operands()
    native.on = False
    loops = {name: _run(product, x, w, g) for name, product in _products().items()}
    assert native.calls == []
    native.on = True
    for name, product in _products().items():
        native.calls.clear()
        got = _run(product, x, w, g)
        # forward and input gradient: 1x128 tiles by 128x128 blocks; weight gradient: by 1x128 tiles (per piece)
        assert native.calls.count("128x128") >= 2 and native.calls.count("1x128") >= 1, (name, native.calls)
        for what, a, b in zip(("y", "dx", "dW"), got, loops[name]):
            assert torch.equal(a, b), (name, what, (a - b).abs().max().item())


def test_a_refused_shape_falls_back_to_the_loop_once(native, monkeypatch):
    x, w, g = _operands()
    native.on = False
    want = _run(_products()["plain"], x, w, g)
    native.on = True
    refusals = []

    def refusing(*args):
        refusals.append(args[0].shape)
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
    monkeypatch.setattr(native_blockwise, "_kernel", refusing)
    with pytest.warns(UserWarning, match="runs tile by tile"):
        got = _run(_products()["plain"], x, w, g)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    tried = len(refusals)
    assert tried == 3  # y, dx, dW: three shapes, each tried once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _run(_products()["plain"], x, w, g)
    assert len(refusals) == tried and all(torch.equal(a, b) for a, b in zip(again, want))


def test_the_probe_takes_the_kernel_only_when_it_runs_and_agrees(native, monkeypatch):
    cpu = torch.device("cpu")
    assert native_blockwise._probe(cpu)  # the stand-in reads the layouts as cuBLAS does

    def unscaled_b(a, b_t, scale_a, scale_b, out):  # a kernel that misreads the second operand's scales
        return out.copy_(native_blockwise.emulated(a, scale_a.contiguous(), b_t.t(), torch.ones_like(scale_a[:1])
                                                   .expand(b_t.shape[1], -1)))
    monkeypatch.setattr(native_blockwise, "_kernel", unscaled_b)
    assert not native_blockwise._probe(cpu)

    def missing(*args):
        raise RuntimeError("Invalid scaling configuration")
    monkeypatch.setattr(native_blockwise, "_kernel", missing)
    assert not native_blockwise._probe(cpu)


def test_only_cuda_devices_are_probed():
    assert not native_blockwise.works(torch.device("cpu"))
