"""``tensor_parallel.output_parts``: a column-parallel linear made in two parts (Ulysses' queries before K and V)
equals the whole linear bit for bit, outputs and the gradients of its input, weight and bias, and its backward
communicates exactly as the whole linear's does (one input-gradient reduction, not one per part): at tp 1, and
at tp 2 with the synchronous entry, sequence parallelism and Domino's asynchronous pieces."""
import contextlib

import pytest
import torch

from megatron_domino.tensor_parallel.context import LayerContext
from megatron_domino.tensor_parallel.layers import column_parallel_linear
from megatron_domino.tensor_parallel.output_parts import column_linear_in_parts
from tests.harness import run_ranks

GROUPS, FIRST, REST, HIDDEN = 2, 12, 8, 16  # per group: the first part's 12 output features, then 8 more
SETTINGS = [dict(grad_pieces=0), dict(grad_pieces=0, sequence_parallel=True), dict(grad_pieces=1),
            dict(grad_pieces=2), dict(grad_pieces=2, sequence_parallel=True)]


def _run(make, x, weight, bias, loss_weights):
    """(first part, rest, dx, dW, db) of a loss that weighs the two parts differently."""
    x, weight, bias = (t.detach().clone().requires_grad_() for t in (x, weight, bias))
    first, rest = make(x, weight, bias)
    loss = (first * loss_weights[0]).sum() + (rest.square() * loss_weights[1]).sum()
    return (first.detach(), rest.detach(), *torch.autograd.grad(loss, (x, weight, bias)))


def _whole(ctx):
    def make(x, weight, bias):
        out = column_parallel_linear(x, weight, bias, ctx)
        grouped = out.view(*out.shape[:-1], -1, FIRST + REST)  # this rank's groups
        return grouped[..., :FIRST].flatten(-2), grouped[..., FIRST:].flatten(-2)
    return make


def _in_parts(ctx, groups):
    def make(x, weight, bias):
        first, rest = column_linear_in_parts(x, weight, bias, ctx, groups, FIRST)
        return first, rest()
    return make


@contextlib.contextmanager
def _recording():
    """The collectives issued within: (group's ranks, name, shape) each."""
    import torch.distributed as dist
    from tests.test_f_and_b_overlap import _record_collectives
    calls = []
    originals = _record_collectives(calls)
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _compare(ctx, x, record=contextlib.nullcontext) -> dict:
    """The two parts against the whole linear, for this rank's piece (``ctx.size`` ranks hold the groups); what
    ``record`` saw of each."""
    groups = GROUPS // ctx.size
    generator = torch.Generator().manual_seed(100 * ctx.rank)
    weight = torch.randn(groups * (FIRST + REST), HIDDEN, dtype=torch.float64, generator=generator)
    bias = torch.randn(groups * (FIRST + REST), dtype=torch.float64, generator=generator)
    lead = (x.shape[0], x.shape[1] * (ctx.size if ctx.sequence_parallel else 1))
    loss_weights = [torch.randn(*lead, groups * width, dtype=torch.float64, generator=generator)
                    for width in (FIRST, REST)]
    results, seen = {}, {}
    for name, make in (("whole", _whole(ctx)), ("parts", _in_parts(ctx, groups))):
        with record() as seen[name]:
            results[name] = _run(make, x, weight, bias, loss_weights)
    for name, a, b in zip(("first part", "rest", "dx", "dW", "db"), results["parts"], results["whole"]):
        assert torch.equal(a, b), (name, ctx.grad_pieces, ctx.sequence_parallel, (a - b).abs().max())
    return seen


@pytest.mark.quick
def test_two_parts_equal_the_whole_linear_on_one_rank():
    x = torch.randn(2, 6, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for setting in SETTINGS:
        _compare(LayerContext(dtype=torch.float64, **setting), x)


def _tp2(rank, world_size):
    import torch.distributed as dist
    group = dist.new_group(list(range(world_size)))
    whole_sequence = torch.randn(2, 8, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for setting in SETTINGS:
        ctx = LayerContext(group=group, dtype=torch.float64, **setting)
        x = whole_sequence.chunk(world_size, dim=1)[rank] if ctx.sequence_parallel else whole_sequence
        seen = _compare(ctx, x, _recording)
        assert seen["parts"] == seen["whole"] and seen["whole"], (setting, seen)
    return True


@pytest.mark.slow
def test_two_parts_equal_the_whole_linear_and_communicate_as_it_does_at_tp2():
    assert all(run_ranks(_tp2, 2, timeout=120))
