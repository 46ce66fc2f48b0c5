"""Blockwise FP8 through cuBLAS's one-call kernel (``fp8/native_blockwise.py``), checked on the CPU.

The kernel runs only on a Hopper GPU (``tests/test_cuda.py`` compares it there). Here ``tests/cublas_blockwise``
stands in: torch's checks at its two doors (v1 and v2), then the scales read from memory as cuBLASLt reads them
(the blocks' with stride round_up(K / 128, 4)). So every product the kernel takes equals the fp64 emulation
exactly only if its scales reach cuBLAS in the layout cuBLAS reads; K = 640 and 1664 (K / 128 = 5, 13) are the
shapes where v1's layout is misread (pytorch#166752).
"""
import warnings

import pytest
import torch

from megatron_domino.fp8 import native_blockwise
from megatron_domino.fp8.linear import linear
from megatron_domino.fp8.scaling import Fp8Recipe, LinearScaling
from megatron_domino.tensor_parallel.async_comm import (
    column_linear_async,
    row_linear_launch,
)
from tests.cublas_blockwise import fronts

pytestmark = pytest.mark.quick
BLOCK = native_blockwise.BLOCK


class _Verdict:
    """``native_blockwise.KERNEL`` with a set verdict (the CPU is never probed)."""

    def __init__(self, path):
        self.path = path

    def works(self, device):
        return bool(self.path)

    def verdict(self, device):
        return self.path


@pytest.fixture
def native(monkeypatch):
    """The stand-in behind both doors; ``native.use(path)`` picks what the probe would have (False: none). Every
    product it makes is checked against the fp64 emulation of the operands ``native_blockwise`` was given."""
    class Native:
        calls, checked = [], []

        @staticmethod
        def use(path):
            monkeypatch.setattr(native_blockwise, "KERNEL", _Verdict(path))
    v1, v2 = fronts(Native.calls)
    monkeypatch.setattr(native_blockwise, "_v1", v1)
    monkeypatch.setattr(native_blockwise, "_v2", v2)
    monkeypatch.setattr(native_blockwise, "_refused", set())
    call = native_blockwise._call

    def checked(path, a, b, a_scale, b_scale, b_tile_rows, out):
        got = call(path, a, b, a_scale, b_scale, b_tile_rows, out)
        want = native_blockwise.emulated(a, a_scale, b, b_scale).to(out.dtype)
        Native.checked.append(torch.equal(got, want))
        return got
    monkeypatch.setattr(native_blockwise, "_call", checked)
    return Native


def _operands(tokens=256, k=640, n=768):
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


def _close(a, b):
    return bool(torch.linalg.vector_norm(a - b) <= 1e-6 * torch.linalg.vector_norm(b))


@pytest.mark.parametrize("k", [512, 640, 1280, 1664])
def test_v2_takes_every_product_and_each_equals_the_fp64_emulation(native, k):
    """The forward contracts K (L = 4, 5, 10, 13) by W's blocks; the input gradient the 768 output features (L = 6)
    by W^T's blocks; Domino's pieces are whole blocks (the config's rule): 384 rows of W, K / 2 rows of W^T."""
    x, w, g = _operands(k=k)
    products = {name: product for name, product in _products().items() if name == "plain" or k % (2 * BLOCK) == 0}
    native.use(False)
    dequantised = {name: _run(product, x, w, g) for name, product in products.items()}
    assert native.calls == []
    native.use("v2")
    for name, product in products.items():
        native.calls.clear(), native.checked.clear()
        got = _run(product, x, w, g)
        kinds = [call[0] for call in native.calls]
        assert kinds.count("128x128") >= 2 and kinds.count("1x128") >= 1, (name, native.calls)
        assert native.checked and all(native.checked), (name, native.calls, native.checked)
        for what, a, b in zip(("y", "dx", "dW"), got, dequantised[name]):  # fp64 against fp32 accumulation
            assert _close(a, b), (name, what)


def test_v1_takes_the_blocks_only_where_cublas_reads_its_layout(native):
    """v1 hands cuBLAS the blocks' scales with stride L: at K = 640 (L = 5) the forward's product, by the weight's
    blocks, multiplies the dequantised operands instead (with one warning); the input gradient (512 outputs
    contracted, L = 4) and the weight gradient (1 x 128 tiles) go through v1."""
    x, w, g = _operands(k=640, n=512)  # the input gradient contracts 512 outputs (L = 4): v1 takes it
    native.use("v1")
    with pytest.warns(UserWarning, match="misreads where K / 128 is not a multiple of 4"):
        _run(_products()["plain"], x, w, g)
    shapes = {(kind, a[1]) for kind, a, _, _ in native.calls}
    assert shapes == {("128x128", 512), ("1x128", 256)}, shapes  # dx by blocks (K 512), dW by tiles (K 256)
    assert all(native.checked)


def test_the_probe_keeps_a_path_only_where_it_equals_the_emulation(native, monkeypatch):
    cpu = torch.device("cpu")
    assert native_blockwise.agrees("v2", cpu) and native_blockwise.agrees("v1", cpu)
    assert native_blockwise._probe(cpu) == native_blockwise.PATHS[0] == "v2"
    v1, v2 = native_blockwise._v1, native_blockwise._v2

    def v2_unpadded(a, b_t, scale_a, recipe_b, scale_b, out):  # a v2 that took v1's layout: misread at L = 5
        if recipe_b.name == "BlockWise128x128":
            return v1(a, b_t, scale_a, scale_b.t()[:, :a.shape[1] // BLOCK].contiguous().t(), out)
        return v2(a, b_t, scale_a, recipe_b, scale_b, out)
    monkeypatch.setattr(native_blockwise, "_v2", v2_unpadded)
    assert not native_blockwise.agrees("v2", cpu) and native_blockwise._probe(cpu) == "v1"

    monkeypatch.setattr(native_blockwise, "takes", lambda path, k, rows: True)  # v1 at L = 5 too: misread
    assert not native_blockwise.agrees("v1", cpu) and native_blockwise._probe(cpu) is False

    def missing(*args):
        raise RuntimeError("Invalid scaling configuration")
    monkeypatch.setattr(native_blockwise, "_v1", missing)
    monkeypatch.setattr(native_blockwise, "_v2", missing)
    assert native_blockwise._probe(cpu) is False


def test_a_refused_shape_falls_back_to_the_dequantised_product_once(native, monkeypatch):
    x, w, g = _operands()
    native.use(False)
    want = _run(_products()["plain"], x, w, g)
    native.use("v2")
    refusals = []

    def refusing(*args):
        refusals.append(args[0].shape)
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
    monkeypatch.setattr(native_blockwise, "_v2", refusing)
    with pytest.warns(UserWarning, match="multiplies the dequantised operands"):
        got = _run(_products()["plain"], x, w, g)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    tried = len(refusals)
    assert tried == 3  # y, dx, dW: three shapes, each tried once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _run(_products()["plain"], x, w, g)
    assert len(refusals) == tried and all(torch.equal(a, b) for a, b in zip(again, want))


def test_only_cuda_devices_are_probed():
    assert not native_blockwise.KERNEL.works(torch.device("cpu"))
