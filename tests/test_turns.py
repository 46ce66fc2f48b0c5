"""parallel/turns.py: an F&B unit's forward and backward take turns at their waits, one side at a time, the
forward's thread computing as the caller would, and a failure on either side ends both and reaches the caller."""
import threading

import pytest
import torch

from megatron_domino.parallel.turns import Turns, TurnTaking

pytestmark = pytest.mark.quick
CPU = torch.device("cpu")
TAKING = TurnTaking()  # a run's: the waits below announce themselves to it


def _side(name, events, waits, fail_at=None, taking=TAKING):
    """A side that records each piece it computes and hands over before each of its ``waits``."""
    handover = taking.before_forward_wait if name == "F" else taking.before_backward_wait

    def run():
        for piece in range(waits + 1):
            if piece == fail_at:
                raise ValueError(f"{name} failed at piece {piece}")
            events.append(f"{name}{piece}")
            if piece < waits:
                handover()
    return run


def test_the_sides_alternate_at_their_waits_forward_first():
    events = []
    unit = Turns(CPU)
    unit.run(_side("F", events, 3), _side("B", events, 2), TAKING)
    assert events == ["F0", "B0", "F1", "B1", "F2", "B2", "F3"]
    assert unit.handovers == 5


def test_a_side_without_waits_runs_whole_and_the_other_finishes_alone():
    events = []
    Turns(CPU).run(_side("F", events, 0), _side("B", events, 2), TAKING)
    assert events == ["F0", "B0", "B1", "B2"]  # nobody left to hand over to: B's waits are plain waits
    events.clear()
    Turns(CPU).run(_side("F", events, 3), _side("B", events, 0), TAKING)
    assert events == ["F0", "B0", "F1", "F2", "F3"]


def test_outside_a_unit_the_handovers_do_nothing():
    TAKING.before_forward_wait()
    TAKING.before_backward_wait()
    events = []
    _side("F", events, 2)()
    assert events == ["F0", "F1", "F2"]


def test_the_forward_computes_as_the_caller_would():
    """Grad mode and the caller's saved-tensor hooks reach the forward's thread; its graph backpropagates."""
    seen, packed = {}, []
    weight = torch.ones(3, requires_grad=True)

    def forward():
        seen["thread"] = threading.current_thread().name
        seen["grad"] = torch.is_grad_enabled()
        seen["out"] = (weight * torch.arange(3.0)).sum()

    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        Turns(CPU).run(forward, lambda: None, TAKING)
    assert seen["thread"] == "f&b-forward" and seen["grad"] and len(packed) == 1
    seen["out"].backward()
    assert torch.equal(weight.grad, torch.arange(3.0))


def test_the_callers_dispatch_modes_see_the_forwards_ops():
    """A dispatch mode the caller runs under (a rehearsal's fake tensors, a FLOP counter) also sees the ops of the
    forward on the helper thread, and is gone from that thread's stack afterwards."""
    from torch.utils._python_dispatch import TorchDispatchMode, _len_torch_dispatch_stack

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append((threading.current_thread().name, func.__name__))
            return func(*args, **(kwargs or {}))

    depth = {}

    def forward():
        torch.ones(2).mul(3)
        depth["inside"] = _len_torch_dispatch_stack()
    with Counting() as counting:
        Turns(CPU).run(forward, lambda: None, TAKING)
    assert ("f&b-forward", "mul.Tensor") in counting.ops and depth["inside"] == 1


def test_a_failing_backward_stops_the_forward_and_is_raised():
    events = []
    with pytest.raises(ValueError, match="B failed at piece 1"):
        Turns(CPU).run(_side("F", events, 5), _side("B", events, 3, fail_at=1), TAKING)
    assert events == ["F0", "B0", "F1"]  # the forward stopped at its next turn
    assert TAKING.active is None
    Turns(CPU).run(_side("F", [], 1), _side("B", [], 1), TAKING)  # the next unit runs


def test_a_failing_forward_lets_the_backward_finish_then_is_raised():
    events = []
    with pytest.raises(ValueError, match="F failed at piece 1"):
        Turns(CPU).run(_side("F", events, 3, fail_at=1), _side("B", events, 2), TAKING)
    assert events == ["F0", "B0", "B1", "B2"]


def test_units_do_not_nest():
    with pytest.raises(RuntimeError, match="do not nest"):
        Turns(CPU).run(lambda: None, lambda: Turns(CPU).run(lambda: None, lambda: None, TAKING), TAKING)
