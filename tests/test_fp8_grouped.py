"""FP8 experts as one step (fp8/grouped.py, fp8/grouped_kernel.py): the numbers of the per-expert loop bit for bit,
with one amax all-reduce per projection instead of one per expert and operand, and CUDA's grouped GEMM fed the
operands its fake kernel checks and the numbers its emulation gives.

- A loop of one FP8 linear per expert and the one step (with and without ``moe_grouped_gemm``) on the same rows
  (uneven experts, one empty), with biases: y, dx, every dW and db equal, for tensorwise and delayed scaling and
  both gradient formats.
- Under expert TP 2 (all-reduces counted, as a rank sees them): the loop issues 2 per expert in fc2's forward,
  1 per expert in fc1's forward and 1 in its backward; the one step 1 each.
- The grouped GEMM's path on the CPU, with a stand-in kernel that multiplies as documented: equal to the loop in
  bf16, the forward (and with e4m3 gradients the input gradient) through the kernel.
- The probe keeps a kernel that agrees with the emulation, and neither one that misreads a scale nor a missing one.
- On the fake CUDA device, torch's fake ``_scaled_grouped_mm`` (CUDA's checks) takes the operands.
"""
import pytest
import torch
import torch.distributed as dist

from megatron_domino.fp8 import grouped_kernel
from megatron_domino.fp8.linear import linear
from megatron_domino.fp8.scaling import GRAD, INPUT, WEIGHT, Fp8Recipe, LinearScaling
from megatron_domino.models.expert_linear import experts_linear
from megatron_domino.parallel import comm
from tests.fake_cuda import on_fake_cuda

pytestmark = pytest.mark.quick

SIZES = [7, 0, 19, 30]


class _Expert(torch.nn.Module):
    def __init__(self, weight, bias, scaling):
        super().__init__()
        self.weight, self.bias, self.fp8 = weight, bias, scaling


def _scaling(kind, grad_format, split=(WEIGHT, INPUT)):
    scaling = LinearScaling(Fp8Recipe(kind, grad_format=grad_format), split, None)
    if kind == "delayed":  # a history already: scales 2^-k, not the calibration step
        scaling.roll_history(torch.tensor([3.0, 0.2, 1e-3]))
    return scaling


def _loop(rows, sizes, experts, bias_divisor):
    """One FP8 linear per expert (what experts_linear ran before the one step; blockwise still does)."""
    parts = rows.split(sizes)
    return torch.cat([linear(part, e.weight, e.bias / bias_divisor, e.fp8) for part, e in zip(parts, experts)])


def _run(mode, kind, grad_format, dtype=torch.float32, seed=0, split=(WEIGHT, INPUT), biased=True):
    """(y, dx, dWs, dbs) of four experts on SIZES rows: ``mode`` "loop", "step" (the one step) or "one gemm" (the
    one step, through the grouped kernel where it serves); ``biased``: the experts have biases."""
    gen = torch.Generator().manual_seed(seed)
    rows = (torch.randn(sum(SIZES), 48, generator=gen) * 3).to(dtype).requires_grad_()
    scaling = _scaling(kind, grad_format, split)
    experts = [_Expert(torch.nn.Parameter((torch.randn(32, 48, generator=gen) * 0.05).to(dtype)),
                       torch.nn.Parameter((torch.randn(32, generator=gen) * 0.1).to(dtype) * biased), scaling)
               for _ in SIZES]
    if mode == "loop":
        y = _loop(rows, SIZES, experts, 2)
    else:
        y = experts_linear(rows, SIZES, experts, mode == "one gemm", bias_divisor=2)
    y.backward((torch.randn(y.shape, generator=gen) * 1e-3).to(dtype))
    return y.detach(), rows.grad, [e.weight.grad for e in experts], [e.bias.grad for e in experts]


def _assert_equal(got, want, where):
    for what, a, b in zip(("y", "dx", "dW", "db"), got, want):
        for index, (x, y) in enumerate(zip(a, b) if isinstance(a, list) else [(a, b)]):
            assert torch.equal(x, y), (where, what, index, (x.float() - y.float()).abs().max().item())


@pytest.mark.parametrize("kind", ["tensorwise", "delayed"])
@pytest.mark.parametrize("grad_format", ["e5m2", "e4m3"])
def test_the_one_step_equals_the_loop_bit_for_bit(kind, grad_format):
    loop = _run("loop", kind, grad_format)
    for mode in ("step", "one gemm"):
        _assert_equal(_run(mode, kind, grad_format), loop, (kind, grad_format, mode))


def test_one_all_reduce_per_projection_instead_of_one_per_expert(monkeypatch):
    """As a rank of expert TP 2 whose partner holds the same amaxes (the reduction is then the identity)."""
    calls = []
    monkeypatch.setattr(comm, "group_size", lambda group: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: calls.append(tensor.numel()))
    counts = {}
    for mode in ("loop", "step"):
        for name, split in (("fc2", (WEIGHT, INPUT)), ("fc1", (WEIGHT, GRAD))):
            calls.clear()
            _run(mode, "tensorwise", "e5m2", split=split)
            counts[mode, name] = list(calls)
    experts = len(SIZES)
    assert counts["loop", "fc2"] == [1] * (2 * experts)  # each expert: its input's and its weight's amax
    assert counts["loop", "fc1"] == [1] * (2 * experts)  # each expert: its weight's, then its output gradient's
    assert counts["step", "fc2"] == [2 * experts]  # every input's and weight's amax at once
    assert counts["step", "fc1"] == [experts, experts]  # the weights' in the forward, the gradients' in the backward


def _stand_in(calls):
    """``torch._scaled_grouped_mm`` as documented: per group of rows, (a x row scale) @ (b[e] x column scale)."""
    def kernel(a, b, scale_a, scale_b, offs, out_dtype):
        assert a.dtype == b.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16 and offs.dtype == torch.int32
        assert a.stride(-1) == 1 and b.stride(-2) == 1  # a row-major, b column-major
        calls.append(tuple(b.shape))
        out, start = [], 0
        for expert, end in enumerate(offs.tolist()):
            product = (a[start:end].float() * scale_a[start:end, None]) @ (b[expert].float() * scale_b[expert])
            out.append(product.to(out_dtype))
            start = end
        return torch.cat(out)
    return kernel


@pytest.mark.parametrize("grad_format", ["e5m2", "e4m3"])
def test_the_grouped_kernels_path_equals_the_loop_in_bf16(monkeypatch, grad_format):
    """Zero biases: the grouped kernel has no bias epilogue (the bias is added to its bf16 output, where a linear's
    GEMM adds it before rounding)."""
    want = _run("loop", "tensorwise", grad_format, torch.bfloat16, biased=False)
    calls = []
    monkeypatch.setattr(grouped_kernel, "works", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _stand_in(calls), raising=False)
    _assert_equal(_run("step", "tensorwise", grad_format, torch.bfloat16, biased=False), want, grad_format)
    assert calls == []  # without model.moe_grouped_gemm: one GEMM per expert
    _assert_equal(_run("one gemm", "tensorwise", grad_format, torch.bfloat16, biased=False), want, grad_format)
    # the forward; with e4m3 gradients the input gradient too (the kernel takes e4m3 only)
    assert calls == [(4, 48, 32)] + ([(4, 32, 48)] if grad_format == "e4m3" else [])
    # a rank whose experts got no rows (capacity drops under EP) loops: the kernel would refuse an empty operand
    scaling = _scaling("tensorwise", grad_format)
    empty = torch.zeros(0, 48, dtype=torch.bfloat16)
    experts = [_Expert(torch.zeros(32, 48, dtype=torch.bfloat16), None, scaling) for _ in SIZES]
    assert experts_linear(empty, [0] * len(SIZES), experts, True).shape == (0, 32) and len(calls) <= 2


def test_a_refused_shape_falls_back_to_the_loop(monkeypatch):
    def refusing(*args, **kwargs):
        raise RuntimeError("not this shape")
    monkeypatch.setattr(grouped_kernel, "works", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", refusing, raising=False)
    monkeypatch.setattr(grouped_kernel, "_refused", set())
    with pytest.warns(UserWarning, match="refused"):
        got = _run("one gemm", "tensorwise", "e5m2", torch.bfloat16)
    _assert_equal(got, _run("loop", "tensorwise", "e5m2", torch.bfloat16), "refused")  # biases in the epilogue


@pytest.mark.parametrize("fp8", [None, "tensorwise", "delayed"])
def test_a_split_backward_runs_each_half_once(monkeypatch, fp8):
    """Zero bubble's I then W (pipeline/split_backward.py) through the grouped experts, bf16's and FP8's: I makes
    the rows' gradient only, W the weights' only, each once, and together they equal an unsplit backward."""
    from megatron_domino.fp8 import grouped
    from megatron_domino.models import expert_linear
    from megatron_domino.pipeline.split_backward import backward_input, backward_weight
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(SIZES), 48, generator=gen, requires_grad=True)
    scaling = None if fp8 is None else _scaling(fp8, "e5m2")
    experts = [_Expert(torch.nn.Parameter(torch.randn(32, 48, generator=gen) * 0.05), None, scaling) for _ in SIZES]
    grad = torch.randn(sum(SIZES), 32, generator=gen)
    params = [x] + [e.weight for e in experts]
    whole = torch.autograd.grad(experts_linear(x * 2, SIZES, experts, grouped=True), params, grad)
    products = {"rows": 0, "weights": 0}
    if fp8 is None:
        def counted(a, b, offs):
            products["weights" if a.shape[0] != x.shape[0] else "rows"] += 1
            return original(a, b, offs=offs)
        original, module, name = expert_linear.grouped_mm, expert_linear, "grouped_mm"
    else:
        def counted(*args):
            products["rows" if args[3] == 2 else "weights"] += 1  # GRAD: the input gradient's products
            return original(*args)
        original, module, name = grouped._products, grouped, "_products"
        monkeypatch.setattr(scaling, "weight_grad", lambda *args: products.__setitem__(
            "weights", products["weights"] + 1) or LinearScaling.weight_grad(scaling, *args))
    monkeypatch.setattr(module, name, counted)
    output = experts_linear(x * 2, SIZES, experts, grouped=True)
    forward = dict(products)
    input_grad, pending = backward_input(output, grad, x)
    after_i = dict(products)
    backward_weight(pending)
    assert after_i["weights"] == forward["weights"] and after_i["rows"] == forward["rows"] + 1
    assert products["rows"] == after_i["rows"] and products["weights"] > after_i["weights"]
    assert torch.equal(input_grad, whole[0])
    for expert, want in zip(experts, whole[1:]):
        assert torch.equal(expert.weight.grad, want)


def test_the_probe_keeps_only_a_kernel_that_runs_and_agrees(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _stand_in([]), raising=False)
    assert grouped_kernel._probe(cpu)
    kernel = _stand_in([])
    monkeypatch.setattr(torch, "_scaled_grouped_mm", lambda a, b, scale_a, scale_b, offs, out_dtype: kernel(
        a, b, scale_a, torch.ones_like(scale_b), offs, out_dtype))  # the weights' scales misread
    assert not grouped_kernel._probe(cpu)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", lambda *args, **kwargs: (_ for _ in ()).throw(
        RuntimeError("no kernel for this GPU")))
    assert not grouped_kernel._probe(cpu)


def _grouped_on_fake_cuda():
    import torch

    from megatron_domino.fp8 import grouped, grouped_kernel
    from megatron_domino.fp8.scaling import WEIGHT, Fp8Recipe, LinearScaling
    from megatron_domino.models.expert_linear import experts_linear
    from tests.fake_cuda import fake_fp8_modes
    from tests.test_fp8_grouped import _Expert
    grouped.to_device = lambda tensor, device: tensor.to(device)  # page-locking fake host memory is the rehearsal's
    kernel, calls = grouped_kernel._kernel, []
    grouped_kernel._kernel = lambda *operands: calls.append(operands[2].shape[1]) or kernel(*operands)
    shapes = []
    # the probe reads values: fake tensors have none
    with fake_fp8_modes(), grouped_kernel.KERNEL.assumed(True, [torch.device("cuda", 0)]):
        for grad_format in ("e4m3", "e5m2"):
            scaling = LinearScaling(Fp8Recipe("tensorwise", grad_format=grad_format), (WEIGHT,), None)
            rows = torch.randn(156, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            experts = [_Expert(torch.randn(48, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True), None,
                               scaling) for _ in range(3)]
            y = experts_linear(rows, [7, 130, 19], experts, grouped=True)
            y.backward(torch.ones_like(y))
            shapes.append([list(y.shape), list(rows.grad.shape), list(experts[0].weight.grad.shape)])
    return shapes, calls


def test_the_fake_cuda_kernel_takes_the_operands():
    shapes, calls = on_fake_cuda("tests.test_fp8_grouped:_grouped_on_fake_cuda")
    assert shapes == [[[156, 48], [156, 256], [48, 256]]] * 2
    assert calls == [48, 256, 48]  # e4m3 gradients: the forward and the input gradient; e5m2: the forward
