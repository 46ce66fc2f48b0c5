"""Blockwise FP8 (128-wide tiles) on every shipped config's per-rank shapes, against the layout cuBLAS reads.

1. On the fake CUDA device, each config (``configs/*/*.yaml``, at its TP) builds a dense and an MoE block and lists
   its FP8 linears' weights as a rank holds them; every product a linear makes (y = x W^T and dx = g W by the
   weight's 128 x 128 blocks, dW = g^T x by x's 1 x 128 tiles) passes torch's own checks through v2 (which enforce
   the padded layout of the blocks) and through v1 where ``native_blockwise`` lets it; and with no kernel (a build
   whose every FP8 GEMM refuses: stood in), forward and backward run on the dequantised product.
2. On the CPU, for each of those products, the scales read from the memory we hand over as cuBLASLt reads it
   (``tests/cublas_blockwise``) equal the operands' own scales: the one-call product then equals the fp64
   emulation (``test_fp8_native_blockwise`` multiplies at K = 640, 1280, 1664). Among the shapes are contractions
   with K / 128 % 4 != 0 (llama3-8b's at tp 8, llama2-7b's, gpt 125m's ...), which v1's layout misreads.
"""
import glob
import os

import pytest
import torch

from megatron_domino.fp8 import native_blockwise
from tests.cublas_blockwise import tile_reads, v1_checks, v2_checks
from tests.fake_cuda import on_fake_cuda

pytestmark = pytest.mark.slow  # every shipped config walked on the fake device: out of the quick tier
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(path for path in glob.glob(os.path.join(REPO, "configs", "*", "*.yaml"))
                 if not path.endswith("base.yaml") and "/tiny/" not in path)
BLOCK = native_blockwise.BLOCK
TOKENS = 640  # a micro-batch's tokens, which the weight gradient contracts: 5 tiles (L % 4 != 0 there too)


def products(out_features: int, in_features: int, tokens: int) -> list[tuple[int, int, int, int]]:
    """A linear's three products as (rows of a, contraction, rows of b, b's tile height)."""
    return [(tokens, in_features, out_features, BLOCK), (tokens, out_features, in_features, BLOCK),
            (out_features, tokens, in_features, 1)]


def _weights(path: str) -> dict:
    """The config's per-rank FP8 weight shapes (a dense and an MoE block, built on fake tensors), or why blockwise
    FP8 with 128-wide tiles is refused at its TP."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_domino.config.loader import load_config
    from megatron_domino.config.validate_fp8 import _blockwise_widths
    from megatron_domino.fp8.scaling import Fp8Recipe, LinearScaling
    from megatron_domino.models.block import TransformerBlock
    from megatron_domino.tensor_parallel import LayerContext
    cfg = load_config(path)
    m, tp = cfg.model, cfg.parallel.tp
    refused = [key for key, width in _blockwise_widths(m, tp).items() if width % BLOCK]
    if refused:
        return {"tp": tp, "refused": refused}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        ctx = LayerContext(group=dist.group.WORLD if tp > 1 else None, dtype=torch.bfloat16,
                           device=torch.device("cuda"), fp8=Fp8Recipe("blockwise"))
        layers = sorted({0, next((n for n in range(m.num_layers) if m.is_moe_layer(n)), 0)})
        shapes = set()
        with FakeTensorMode(allow_non_fake_inputs=True):
            for layer in layers:
                block = TransformerBlock(m, ctx, layer_number=layer)
                shapes |= {tuple(module.weight.shape) for module in block.modules()
                           if isinstance(getattr(module, "fp8", None), LinearScaling)}
    finally:
        dist.destroy_process_group()
    return {"tp": tp, "weights": sorted(shapes), "tokens": TOKENS}


def _cuda_checks(weights: list, tokens: int) -> list:
    """Every product through v2 and v1 (where taken), into torch's fake CUDA kernels; then each linear forward and
    backward with no kernel, where every FP8 GEMM refuses. Returns the paths each product took."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_domino.fp8.linear import linear
    from megatron_domino.fp8.scaling import Fp8Recipe, LinearScaling
    from tests.fake_cuda import fake_fp8_modes
    e4m3 = torch.float8_e4m3fn

    class NoFp8Gemm(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "_scaled_mm" in str(func):
                raise RuntimeError("this build has no FP8 GEMM")
            return func(*args, **(kwargs or {}))
    taken, cuda = [], torch.device("cuda", 0)
    with fake_fp8_modes():
        for out_features, in_features in weights:
            for m, k, n, rows in products(out_features, in_features, tokens):
                a, b = torch.empty(m, k, device=cuda, dtype=e4m3), torch.empty(n, k, device=cuda, dtype=e4m3)
                # rows-major, as quantize_tiles makes them
                a_scale, b_scale = (torch.ones(k // BLOCK, size, device=cuda).t() for size in (m, n))
                for path in native_blockwise.PATHS:
                    if native_blockwise.takes(path, k, rows):
                        out = torch.empty(m, n, device=cuda, dtype=torch.bfloat16)
                        native_blockwise._call(path, a, b, a_scale, b_scale, rows, out)
                        taken.append([m, k, n, rows, path])
            with native_blockwise.KERNEL.assumed(False, [cuda]), NoFp8Gemm():
                x = torch.randn(256, in_features, device=cuda, dtype=torch.bfloat16, requires_grad=True)
                w = torch.randn(out_features, in_features, device=cuda, dtype=torch.bfloat16, requires_grad=True)
                linear(x, w, None, LinearScaling(Fp8Recipe("blockwise"), (), None)).sum().backward()
                assert x.grad.shape == x.shape and w.grad.shape == w.shape
    return taken


def _walk(paths: list) -> dict:
    walked = {}
    for path in paths:
        walked[path] = found = _weights(path)
        if "weights" in found:
            found["taken"] = _cuda_checks(found["weights"], found["tokens"])
    return walked


@pytest.fixture(scope="module")
def walked():
    return on_fake_cuda("tests.test_fp8_blockwise_shapes:_walk", CONFIGS, timeout=600)


def test_every_config_runs_blockwise_through_torchs_checks_or_is_refused_by_the_config(walked):
    assert sorted(walked) == CONFIGS
    refused = {os.path.relpath(path, REPO): found["refused"] for path, found in walked.items() if "refused" in found}
    ran = {path: found for path, found in walked.items() if "refused" not in found}
    assert len(ran) >= len(CONFIGS) - 3, refused  # blockwise needs TP pieces of whole 128-wide blocks
    misread = set()
    for found in ran.values():
        assert found["weights"], found
        paths = {(m, k, n, rows): set() for out, inp in found["weights"] for m, k, n, rows in
                 products(out, inp, found["tokens"])}
        for m, k, n, rows, path in found["taken"]:
            paths[(m, k, n, rows)].add(path)
        assert all("v2" in taken for taken in paths.values()), found
        misread |= {k for (m, k, n, rows), taken in paths.items() if rows == BLOCK and "v1" not in taken}
    assert misread and all((k // BLOCK) % 4 for k in misread), misread  # v1 left out exactly there


def _scales(rows: int, k: int, tile_rows: int, gen) -> torch.Tensor:
    exponents = torch.randint(-8, 8, (-(-rows // tile_rows), k // BLOCK), generator=gen)
    return torch.exp2(exponents.float()).repeat_interleave(tile_rows, 0)[:rows].t().contiguous().t()  # rows-major


def test_cublas_reads_the_scales_we_hand_over_on_every_configs_products(walked, monkeypatch):
    got = []  # what cuBLAS is handed, after torch's checks
    monkeypatch.setattr(native_blockwise, "_v1", lambda a, b_t, *scales: got.append(v1_checks(a, b_t, *scales[:2])))
    monkeypatch.setattr(native_blockwise, "_v2", lambda a, b_t, *scales: got.append(v2_checks(a, b_t, *scales[:3])))
    gen, e4m3 = torch.Generator().manual_seed(0), torch.float8_e4m3fn
    distinct = {tuple(taken) for found in walked.values() for taken in found.get("taken", [])}
    for m, k, n, rows, path in sorted(distinct):
        a_scale, b_scale = _scales(m, k, 1, gen), _scales(n, k, rows, gen)
        a, b = (torch.zeros((), dtype=e4m3).expand(size, k) for size in (m, n))  # their shapes are what is read
        got.clear()
        native_blockwise._call(path, a, b, a_scale, b_scale, rows, None)
        read_a, read_b = tile_reads(m, k, n, *got[0])
        assert torch.equal(read_a, a_scale), (m, k, n, rows, path)
        assert torch.equal(read_b, b_scale[::rows]), (m, k, n, rows, path)
    assert len(distinct) > 20
