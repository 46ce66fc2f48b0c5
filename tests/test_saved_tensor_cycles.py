"""A split backward (zb-h1, zb-v, dualpipev) frees what only its I pass used once W has run, also under the pack
hooks that ZeRO-3 and the rehearsal install: a hook that returned the saved tensor itself would make a saved output
hold its own node, a cycle that only a whole backward breaks (a leak per micro-batch)."""
import gc
import types
import weakref

import pytest
import torch

from megatron_domino.optim.weight_units import WeightUnits
from megatron_domino.pipeline.split_backward import backward_input, backward_weight
from megatron_domino.rehearsal.memory import AllocationAccounting

pytestmark = pytest.mark.quick


def _zero3_hooks():
    units = types.SimpleNamespace(by_storage={})  # no gathered weight here: every tensor is an activation
    return (lambda t: WeightUnits.pack(units, t)), (lambda packed: WeightUnits.unpack(units, packed))


def _rehearsal_hooks():
    accounting = types.SimpleNamespace(claim=lambda tensors, category: None)
    return (lambda t: AllocationAccounting.saved_for_backward(accounting, t)), (lambda packed: packed)


@pytest.mark.parametrize("hooks", [_zero3_hooks, _rehearsal_hooks], ids=["zero3", "rehearsal"])
def test_an_output_saved_by_its_own_node_is_freed_after_w(hooks):
    stage_input = torch.randn(4, 4, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(4, 4))
    with torch.autograd.graph.saved_tensors_hooks(*hooks()):
        saved = (stage_input @ weight).exp()  # exp saves its output: an I-only node (the input's path)
        output = saved * 2
    alive = weakref.ref(saved)
    input_grad, pending = backward_input(output, None, stage_input)
    backward_weight(pending)
    assert input_grad is not None and weight.grad is not None
    del saved, output, pending, input_grad
    gc.collect()
    assert alive() is None
