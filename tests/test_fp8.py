"""FP8 GEMMs (fp8/): every recipe's three products equal an emulated reference (quantise with the same scale, multiply
in fp32) exactly, in every layer kind (column- and row-parallel, Domino's asynchronous column linear and its row
pieces, the experts); delayed scaling's history and scales; bad configs refused before any process group starts."""
from dataclasses import replace

import pytest
import torch

from megatron_domino.config import Config, ConfigError
from megatron_domino.fp8.linear import linear
from megatron_domino.fp8.quantize import _product
from megatron_domino.fp8.scaling import GRAD, INPUT, WEIGHT, Fp8Recipe, LinearScaling
from megatron_domino.models.expert_linear import experts_linear
from megatron_domino.tensor_parallel import ColumnParallelLinear, LayerContext, RowParallelLinear
from megatron_domino.tensor_parallel.async_comm import column_linear_async, row_linear_launch
from megatron_domino.validation import validate_config
from tests.test_pipeline import GPT

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BLOCK = 8


def _pow2_scale(amax, dtype):
    scale = 2.0 ** torch.ceil(torch.log2(amax.float() / torch.finfo(dtype).max))
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _q(x, scale, dtype):
    """Quantise-dequantise with ``scale`` (per element, broadcast): the emulated FP8 value."""
    limit = torch.finfo(dtype).max
    return (x / scale).clamp(-limit, limit).to(dtype).float() * scale


def _tile_scales(x, rows, cols, dtype):
    """Per-element scales of ``rows`` x ``cols`` tiles (x's sizes are multiples here)."""
    r, c = x.shape
    amax = x.abs().view(r // rows, rows, c // cols, cols).amax(dim=(1, 3))
    return _pow2_scale(amax, dtype).repeat_interleave(rows, 0).repeat_interleave(cols, 1)


def _emulated(a, b, sa, sb, da, db):
    """a @ b^T of the emulated operands, one product accumulated in fp32 (blockwise too: its dequantised operands
    are exact, so this is what an fp32-accumulating blockwise kernel computes)."""
    return _q(a, sa, da) @ _q(b, sb, db).t()


def _reference(kind, x, w, g):
    """(y, dx, dW) of y = x W^T as each recipe defines them (delayed: a history holding these operands' amaxes)."""
    if kind == "blockwise":
        y = _emulated(x, w, _tile_scales(x, 1, BLOCK, E4M3), _tile_scales(w, BLOCK, BLOCK, E4M3), E4M3, E4M3)
        wt = w.t().contiguous()
        dx = _emulated(g, wt, _tile_scales(g, 1, BLOCK, E5M2), _tile_scales(wt, BLOCK, BLOCK, E4M3), E5M2, E4M3)
        gt, xt = g.t().contiguous(), x.t().contiguous()
        dw = _emulated(gt, xt, _tile_scales(gt, 1, BLOCK, E5M2), _tile_scales(xt, 1, BLOCK, E4M3), E5M2, E4M3)
        return y, dx, dw
    sx, sw = _pow2_scale(x.abs().amax(), E4M3), _pow2_scale(w.abs().amax(), E4M3)  # delayed: the history's
    sg = _pow2_scale(g.abs().amax(), E5M2)
    y = _emulated(x, w, sx, sw, E4M3, E4M3)
    dx = _emulated(g, w.t(), sg, sw, E5M2, E4M3)
    dw = _emulated(g.t(), x.t(), sg, sx, E5M2, E4M3)
    return y, dx, dw


def _operands(seed=0, tokens=32, k=48, n=32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen) * 3
    w = torch.randn(n, k, generator=gen) * 0.05
    g = torch.randn(tokens, n, generator=gen) * 1e-3
    return x, w, g


def _run(product, x, w, g):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = product(x, w)
    y.backward(g)
    return y.detach(), x.grad, w.grad


RECIPES = ("tensorwise", "delayed", "blockwise")


@pytest.mark.parametrize("kind", RECIPES)
def test_every_layer_kind_equals_the_emulated_reference_exactly(kind):
    recipe = Fp8Recipe(kind, block=BLOCK)
    x, w, g = _operands()
    want = _reference(kind, x, w, g)

    def scaling():  # a fresh state per layer kind; delayed: one step of history already
        state = LinearScaling(recipe, (), None)
        if kind == "delayed":
            state.roll_history(torch.stack([x.abs().amax(), w.abs().amax(), g.abs().amax()]))
        return state

    kinds = {
        "plain": lambda x, w: linear(x, w, None, scaling()),
        "domino column (2 input-gradient pieces)": lambda x, w, s=scaling(): column_linear_async(x, w, None, None, 2,
                                                                                                  fp8=s),
        "domino row (2 output pieces)": lambda x, w, s=scaling(): row_linear_launch(x, w, None, 2, fp8=s).wait(),
        "experts (2, loop)": lambda x, w, s=scaling(): _experts(x, w, s),
    }
    for name, product in kinds.items():
        got = _run(product, x, w, g)
        for what, a, b in zip(("y", "dx", "dW"), got, want):
            assert torch.equal(a, b), (kind, name, what, (a - b).abs().max().item())


class _Expert(torch.nn.Module):
    def __init__(self, weight, scaling):
        super().__init__()
        self.weight, self.bias, self.fp8 = weight, None, scaling


def _experts(x, w, scaling):
    """Two experts holding the same weight, on 24 and 8 of the rows: each runs its own scaled GEMM."""
    if scaling.recipe.kind == "blockwise":  # tiles of tokens per expert: the rows split at a tile boundary
        sizes = [24, 8]
    else:  # per-tensor scales per expert: one expert with all rows reproduces the whole product
        sizes = [32, 0]
    return experts_linear(x, sizes, [_Expert(w, scaling), _Expert(w, scaling)], grouped=True)


def test_layers_build_their_scalings_from_the_context():
    ctx = LayerContext(fp8=Fp8Recipe("tensorwise"))
    column, row = ColumnParallelLinear(16, 32, ctx), RowParallelLinear(32, 16, ctx)
    assert column.fp8.split == (WEIGHT, GRAD) and row.fp8.split == (WEIGHT, INPUT)
    assert ColumnParallelLinear(16, 32, LayerContext()).fp8 is None


def test_delayed_scaling_calibrates_its_first_step_unquantised():
    """No history yet: the step multiplies in the weights' dtype (exactly F.linear's numbers) and records amaxes."""
    x, w, g = _operands(seed=2)
    scaling = LinearScaling(Fp8Recipe("delayed"), (), None)
    y, dx, dw = _run(lambda x, w: linear(x, w, None, scaling), x, w, g)
    assert torch.equal(y, x @ w.t()) and torch.equal(dx, g @ w) and torch.equal(dw, g.t() @ x)
    assert torch.equal(scaling.current, torch.stack([x.abs().amax(), w.abs().amax(), g.abs().amax()]))
    scaling.roll_history(scaling.current.clone())
    assert not scaling.calibrating and not torch.equal(linear(x, w, None, scaling), y)  # FP8 from now on


def test_delayed_scales_come_from_the_history():
    recipe = Fp8Recipe("delayed", history_len=3, amax_compute="max")
    scaling = LinearScaling(recipe, (), None)
    assert scaling.calibrating
    for amax in (torch.tensor([448.0, 4.0, 57344.0]), torch.tensor([896.0, 2.0, 1.0]), torch.tensor([1.0, 1.0, 1.0])):
        scaling.scale(torch.full((2,), amax[INPUT].item()), INPUT)  # records the running amax of the step
        assert scaling.current[INPUT] == amax[INPUT]
        scaling.roll_history(amax)
    assert torch.equal(scaling.history[:, INPUT], torch.tensor([1.0, 896.0, 448.0]))
    assert scaling.scales.tolist() == [2.0, 1 / 64, 1.0]  # max over the history, rounded up to a power of two
    most_recent = LinearScaling(replace(recipe, amax_compute="most_recent"), (), None)
    most_recent.roll_history(torch.tensor([448.0, 448.0, 57344.0 * 4]))
    assert most_recent.scales.tolist() == [1.0, 1.0, 4.0] and not most_recent.current.any()


def _refused(model=None, world_size=1, **parallel):
    cfg = Config(model=replace(GPT, **(model or {})))
    cfg.data.mock = True
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    with pytest.raises(ConfigError) as problem:
        validate_config(cfg, world_size=world_size, check_paths=False)
    return str(problem.value)


def test_bad_fp8_configs_are_refused_before_any_process_group_starts(monkeypatch):
    assert "model.fp8_block_size = 16" in _refused(dict(fp8="blockwise", fp8_block_size=16), 4, tp=4)  # 32 / 4 = 8
    assert "tokens of a sequence" in _refused(dict(fp8="blockwise", fp8_block_size=8, seq_length=20))
    assert "model.fp8 = 'fp4'" in _refused(dict(fp8="fp4"))
    assert "model.fp8_grad_format" in _refused(dict(fp8="delayed", fp8_grad_format="e3m4"))
    cfg = Config(model=replace(GPT, fp8="tensorwise"))
    cfg.data.mock, cfg.train.fp16 = True, True
    with pytest.raises(ConfigError, match="set train.bf16=true"):
        validate_config(cfg, world_size=1, check_paths=False)
    monkeypatch.delattr(torch, "float8_e5m2")
    assert "has no float8 dtypes" in _refused(dict(fp8="tensorwise"))
    assert "has no float8 dtypes" in _refused(dict(fp8="blockwise", fp8_block_size=8))  # what blockwise needs


@pytest.mark.slow  # an inductor compile: half a minute, out of the quick tier
def test_compiled_casts_equal_eager_ones_bit_for_bit():
    """model.compile: the amaxes and casts run as compiled kernels and give the same FP8 products."""
    x, w, g = _operands(seed=1)
    for kind in ("tensorwise", "blockwise"):
        eager = _run(lambda x, w: linear(x, w, None, LinearScaling(Fp8Recipe(kind, block=BLOCK), (), None)), x, w, g)
        recipe = Fp8Recipe(kind, block=BLOCK, compiled=True)
        compiled = _run(lambda x, w: linear(x, w, None, LinearScaling(recipe, (), None)), x, w, g)
        for what, a, b in zip(("y", "dx", "dW"), compiled, eager):
            assert torch.equal(a, b), (kind, what)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cpu_product_equals_torch_scaled_mm_bit_for_bit(out_dtype):
    """On the CPU the FP8 product skips torch's slow _scaled_mm kernel; it must compute exactly what that kernel does,
    per-tensor and row-wise scales, both formats, into a given buffer or a new one."""
    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(40, 96, generator=gen) * 3).to(E4M3)
    b = (torch.randn(24, 96, generator=gen) * 5).to(E5M2)
    scales = [(torch.tensor(0.375), torch.tensor(0.0625)),
              (torch.rand(40, 1, generator=gen) + 0.1, torch.rand(1, 24, generator=gen) + 0.1)]
    for scale_a, scale_b in scales:
        expected = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        assert torch.equal(_product(a, b.t(), scale_a, scale_b, out_dtype), expected)
        out = torch.empty(40, 24, dtype=out_dtype)
        assert _product(a, b.t(), scale_a, scale_b, out_dtype, out) is out and torch.equal(out, expected)


@pytest.mark.parametrize("kind", RECIPES)
def test_a_steps_weight_copies_are_made_once_and_give_the_same_products(kind, monkeypatch):
    """During a step (``step_weights``) W and W^T are quantised at their first use and reused by every later
    micro-batch; the products are bit for bit those of a copy per use."""
    x, w, g = _operands(seed=4)
    made = []
    quantise = LinearScaling._tensorwise if kind != "blockwise" else LinearScaling._tiles
    monkeypatch.setattr(LinearScaling, "_tensorwise" if kind != "blockwise" else "_tiles",
                        lambda self, x2d, operand, *rest: made.append(operand) or quantise(self, x2d, operand, *rest))

    def scaling():
        state = LinearScaling(Fp8Recipe(kind, block=BLOCK), (), None)
        state.calibrating = False  # delayed: scales from a history (ones here)
        return state
    def microbatches(state):  # one weight, three micro-batches
        weight, results = w.clone().requires_grad_(), []
        for _ in range(3):
            inputs = x.clone().requires_grad_()
            y = linear(inputs, weight, None, state)
            y.backward(g)
            results.append((y.detach(), inputs.grad, weight.grad.clone()))
        return results
    want = microbatches(scaling())
    assert made.count(WEIGHT) == 6  # W and W^T, each micro-batch
    made.clear()
    in_step = scaling()
    in_step.step_weights = {}
    got = microbatches(in_step)
    assert made.count(WEIGHT) == 2
    for a, b in zip(got, want):
        assert all(torch.equal(p, q) for p, q in zip(a, b))
