"""The benchmark harnesses' own arithmetic: the plain reference model, activation accounting, timelines."""
import itertools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import checkpoint  # noqa: E402
import domino  # noqa: E402
import memory  # noqa: E402
import pipeline  # noqa: E402
import plain_pytorch_gpt as plain  # noqa: E402
import planner_generated  # noqa: E402
from common import MODEL_FLAGS, forward_flags  # noqa: E402
from spans import SpanRecorder  # noqa: E402

from megatron_domino.config import ModelConfig  # noqa: E402
from megatron_domino.models import LanguageModel, initialize_weights  # noqa: E402


def test_plain_gpt_computes_the_framework_model():
    """Two independent implementations, one set of weights: the same loss and gradients."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=256,
                      attention_dropout=0.0, hidden_dropout=0.0)
    ours = LanguageModel(cfg)
    initialize_weights(ours, seed=3)
    reference = plain.PlainGPT(256, 32, 4, 2, 16)
    reference.load_state_dict(ours.state_dict(), strict=True)
    tokens = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(0))
    loss = ours(None, {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}).mean()
    loss.backward()
    plain_loss = plain.forward_backward(reference, tokens[:, :-1], tokens[:, 1:])
    assert abs(loss.item() - plain_loss.item()) < 1e-5
    grads = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.allclose(param.grad, grads[name].grad, atol=1e-6), name


def test_saved_activations_count_each_storage_once_and_drop_to_zero():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    saved = memory.SavedActivations([weight])
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        h = x * 2.0  # saves nothing for x (constant factor)
        y = torch.tanh(h @ weight)  # mm saves h (weight is skipped); tanh saves its output
        z = (y[:2] * y[2:]).sum()  # saves two views of y: y's storage is already counted
    expected = h.numel() * 4 + y.numel() * 4
    assert saved.peak == expected
    z.backward()
    assert saved.live == 0 and not saved.refs


def test_compute_spans_are_the_window_minus_blocked_time():
    recorder = SpanRecorder(rank=0)
    recorder.window = (0.0, 10.0)
    recorder.main = [("wait a", 2.0, 3.0), ("wait b", 2.5, 4.0), ("wait c", 9.0, 10.0)]
    assert recorder.compute_spans() == [("compute", 0.0, 2.0), ("compute", 4.0, 9.0)]
    events = [e for e in recorder.chrome_events() if e["ph"] == "X"]
    assert sum(e["dur"] for e in events if e["name"] == "compute") == pytest.approx(7e6)


def test_pipeline_analysis_of_a_simulated_timeline_reproduces_the_simulation():
    """Feed the simulator's own op times in as 'measured': busy, idle and every prediction must agree."""
    from megatron_domino.pipeline.schedules import build_schedule
    from megatron_domino.pipeline.simulate import simulate
    for (schedule, v), pp in itertools.product(pipeline.SCHEDULES.items(), (2, 4)):
        m = 8
        result = simulate(build_schedule(schedule, pp, m, v), m, v, v_shape=schedule in pipeline.V_SHAPED)
        steps = [[(s.instruction.op, s.instruction.chunk, s.instruction.microbatch, s.start, s.end) for s in row]
                 for row in result.spans]
        analysis = pipeline.analyse([[ops] for ops in steps], schedule, m, pp)
        assert analysis["closed_form_bubble"] == pytest.approx(pipeline.closed_form(schedule, m, pp))
        for rank, row in enumerate(analysis["ranks"]):
            assert row["idle_fraction"] == pytest.approx(result.idle_fraction[rank])
            assert row["sim_measured_idle_fraction"] == pytest.approx(result.idle_fraction[rank])
        if v == 1:  # equal stages, backward = 2 x forward (ZB-H1: B = W = forward): the closed form is exact
            assert analysis["measured_bubble"] == pytest.approx(pipeline.closed_form(schedule, m, pp))


def test_driver_flags_reach_the_worker_unchanged():
    args = domino.parse_args(["--hidden", "256", "--no-bf16", "--rounds", "2", "--modes", "sync,row-inter,nocomm"])
    again = domino.parse_args(forward_flags(args, ("hidden", "bf16", "rounds", "modes")) + ["--worker"])
    assert (again.hidden, again.bf16, again.rounds, again.modes) == (256, False, 2, "sync,row-inter,nocomm")
    with pytest.raises(SystemExit):
        domino.parse_args(["--modes", "sync,row-inter"])  # no nocomm: the hidden fraction is undefined


def test_checkpoint_small_preset_reaches_the_worker_and_the_table_takes_the_slowest_rank():
    small = checkpoint.parse_args(["--small"])
    worker = checkpoint.parse_args(forward_flags(small, MODEL_FLAGS) + ["--worker"])
    assert {name: getattr(worker, name) for name in checkpoint.SMALL} == checkpoint.SMALL
    mib = checkpoint.MIB
    ranks = [{"variant": "new async", "blocking_s": 1.0, "total_s": 3.0, "load_s": 0.5, "peak_bytes": 5 * mib,
              "before_bytes": 1 * mib, "own_bytes": 2 * mib},
             {"variant": "new async", "blocking_s": 2.0, "total_s": 2.5, "load_s": 0.25, "peak_bytes": 3 * mib,
              "before_bytes": 1 * mib, "own_bytes": 4 * mib}]
    assert checkpoint.summarize(ranks) == [["new async", "2.00", "3.00", "0.50", "5 / 4", "4 / 3", "4 / 3"]]


@pytest.mark.slow  # about 10 s of layout searches
def test_generated_layouts_are_valid_reproducible_and_span_the_schedules():
    """benchmarks/planner_generated.py's draws: the same for a seed, each family's, each config valid at its world
    size, and (over a few seeds) pipelines with one chunk and with several, and ZeRO stages beyond 1."""
    from megatron_domino.config.loader import load_config
    from megatron_domino.validation import validate_config
    specs = planner_generated.generated_layouts(1, 2, 8)
    assert specs == planner_generated.generated_layouts(1, 2, 8)
    assert [path for path, _, _ in specs] == [path for path in planner_generated.FAMILIES for _ in range(2)]
    for path, world, overrides in specs:
        validate_config(load_config(os.path.join(planner_generated.REPO, path), overrides), world, check_paths=False)
    drawn = [o for seed in range(3) for _, _, overrides in planner_generated.generated_layouts(seed, 2, 8)
             for o in overrides]
    assert {"parallel.virtual_pp=1", "parallel.virtual_pp=2", "optimizer.zero_stage=3"} <= set(drawn)
