"""ZB-V and DualPipeV as data: deadlock-free under NCCL's rules (the simulator) for pp 2, 4, 8 and m from pp
(2 pp for DualPipeV) to 32, their closed-form bubble and peak in-flight micro-batches met, the V's layout and
local handoff, and the config rules. Single process."""
import pytest

from megatron_domino.config.errors import ConfigError
from megatron_domino.config.loader import config_from_dict
from megatron_domino.pipeline.program import Overlapped, TransferGroup, stage_rank, virtual_stage
from megatron_domino.pipeline.schedules import build_schedule, chunk_stage
from megatron_domino.pipeline.simulate import simulate
from tests.tools import load_tool

print_schedule = load_tool("print_schedule").main

pytestmark = pytest.mark.quick
GRID = [(pp, m) for pp in (2, 4, 8) for m in range(pp, 33, pp)]


def _run(kind, pp, m):
    return simulate(build_schedule(kind, pp, m, 2), m, 2, v_shape=True)


@pytest.mark.parametrize("pp,m", GRID)
def test_zb_v_closed_forms(pp, m):
    """Bubble (pp - 1) / (6 m + pp - 1); 2 pp chunk-micro-batches (pp stages' worth, 1F1B's peak) on every rank."""
    result = _run("zb-v", pp, m)
    assert result.bubble_fraction == pytest.approx((pp - 1) / (6 * m + pp - 1), abs=1e-12)
    assert result.max_in_flight == [2 * pp] * pp
    one_f_one_b = simulate(build_schedule("1f1b", pp, m), m)
    assert max(result.max_in_flight) / 2 <= max(one_f_one_b.max_in_flight)


@pytest.mark.parametrize("pp,m", [(pp, m) for pp, m in GRID if m >= 2 * pp])
def test_dualpipe_v_closed_forms(pp, m):
    """With F&B credited no overlap (F + B), bubble (7 pp - 5) / (6 m + 7 pp - 5); 2 pp + 1 chunk-micro-batches
    in flight (the F&B unit holds its forward's activations before its backward frees the other's)."""
    result = _run("dualpipev", pp, m)
    assert result.bubble_fraction == pytest.approx((7 * pp - 5) / (6 * m + 7 * pp - 5), abs=1e-12)
    assert result.max_in_flight == [2 * pp + 1] * pp
    program = build_schedule("dualpipev", pp, m, 2)
    assert all(any(isinstance(s, Overlapped) for s in p) for p in program)


def test_pp4_m16_beside_the_others():
    """The issue's numbers: ZB-V below ZB-H1's bubble, at 1F1B's activation memory."""
    zb_v, zb_h1 = _run("zb-v", 4, 16), simulate(build_schedule("zb-h1", 4, 16), 16)
    one_f_one_b = simulate(build_schedule("1f1b", 4, 16), 16)
    assert zb_v.bubble_fraction < zb_h1.bubble_fraction < one_f_one_b.bubble_fraction
    assert zb_h1.bubble_fraction == pytest.approx(3 / 51)
    assert max(one_f_one_b.max_in_flight) == 4 and max(zb_v.max_in_flight) == 8  # 8 half-stages = 4 stages


def test_v_layout_and_local_handoff():
    """Rank 0 holds the first and last stage; the turn on rank pp - 1 sends nothing."""
    pp = 4
    assert [virtual_stage(r, c, pp, True) for r in range(pp) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert all(stage_rank(virtual_stage(r, c, pp, True), pp, True) == r for r in range(pp) for c in (0, 1))
    turn = build_schedule("zb-v", pp, 8, 2)[pp - 1]
    moved = {(t.op, t.chunk) for s in turn if isinstance(s, TransferGroup) for t in s.transfers}
    assert ("send_forward", 0) not in moved and ("recv_forward", 1) not in moved
    assert ("send_backward", 1) not in moved and ("recv_backward", 0) not in moved


def test_config_implies_and_refuses_virtual_pp():
    cfg = config_from_dict({"parallel": {"pp": 4, "pipeline_schedule": "zb-v"}})
    assert cfg.parallel.virtual_pp == 2
    assert [chunk_stage(cfg.parallel, 0, c) for c in (0, 1)] == [0, 7]
    cfg.parallel.pipeline_schedule = "interleaved"
    assert [chunk_stage(cfg.parallel, 0, c) for c in (0, 1)] == [0, 4]
    refused = (("zb-v", 3, 8, "parallel.virtual_pp"), ("dualpipev", 1, 8, "parallel.virtual_pp"),
               ("dualpipev", 2, 7, "parallel.pipeline_schedule"), ("zb-v", 2, 3, "parallel.pipeline_schedule"))
    for kind, vpp, m, key in refused:
        with pytest.raises(ConfigError, match=key):
            build_schedule(kind, 4, m, vpp)


@pytest.mark.parametrize("kind", ["zb-v", "dualpipev"])
def test_printed(kind, capsys):
    assert print_schedule(["--pp", "2", "--microbatches", "4", "--kind", kind, "--ops"]) == 0
    out = capsys.readouterr().out
    assert "bubble fraction" in out and "rank 1 ops" in out


@pytest.mark.quick
def test_print_schedule_shows_a_runs_v(capsys):
    """--print-schedule of a pretraining command: the run's own V schedule, m from the batch sizes, no group."""
    import os
    from megatron_domino.training.cli import main
    from tests.training_runs import REPO
    config = os.path.join(REPO, "configs/tiny/gpt.yaml")
    assert main(["--print-schedule", "--world-size", "2", "--config", config, "data.mock=true",
                 "tokenizer.type=NullTokenizer", "tokenizer.model=null", "parallel.pp=2",
                 "parallel.pipeline_schedule=zb-v", "train.global_batch_size=8", "parallel.backend=gloo"]) == 0
    out = capsys.readouterr().out
    assert "zb-v" in out and "rank 1" in out
