"""benchmarks/pipeline.py for the V schedules (zb-v, dualpipev): its arithmetic on simulated timelines, and one tiny
run at pp 2 with fixed-time stages (the plumbing: a row per (schedule, m), a bubble in [0, 1], the peak in flight
counted in the run, and the configuration dualpipev cannot run skipped with its reason)."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.training_runs import REPO, environment

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import pipeline  # noqa: E402

V_SCHEDULES = ("zb-v", "dualpipev")


@pytest.mark.parametrize("schedule", V_SCHEDULES)
@pytest.mark.parametrize("pp", (2, 4))
def test_analysis_of_a_simulated_v_timeline_reproduces_the_simulation_and_its_closed_forms(schedule, pp):
    """The simulator's own op times fed in as 'measured' (F 1, B 2, I = W = 1; DualPipeV's F&B as its halves): every
    prediction agrees with it, and the closed forms of bubble and peak in flight are exact."""
    from megatron_domino.pipeline.schedules import build_schedule
    from megatron_domino.pipeline.simulate import simulate
    for m in (2 * pp, 2 * pp + 3, 16):
        result = simulate(build_schedule(schedule, pp, m, 2), m, 2, v_shape=True)
        steps = [[(s.instruction.op, s.instruction.chunk, s.instruction.microbatch, s.start, s.end) for s in row]
                 for row in result.spans]
        analysis = pipeline.analyse([[ops] for ops in steps], schedule, m, pp)
        assert analysis["virtual_pp"] == 2
        assert analysis["closed_form_bubble"] == pytest.approx(result.bubble_fraction)
        assert analysis["measured_bubble"] == pytest.approx(result.bubble_fraction)
        assert analysis["sim_unit_bubble"] == pytest.approx(result.bubble_fraction)
        assert analysis["sim_measured_bubble"] == pytest.approx(result.bubble_fraction)
        assert analysis["peak_in_flight"] == analysis["closed_form_peak"] == 2 * pp + (schedule == "dualpipev")
        for rank, row in enumerate(analysis["ranks"]):
            assert row["idle_fraction"] == pytest.approx(result.idle_fraction[rank])
            assert row["in_flight"] == row["sim_in_flight"] == result.max_in_flight[rank]


def test_the_issue_numbers_and_what_is_skipped():
    assert pipeline.closed_form("zb-v", 16, 4) == pytest.approx(3 / 99)  # 0.0303
    assert pipeline.closed_form("dualpipev", 16, 4) == pytest.approx(23 / 119)
    assert pipeline.closed_form("zb-v", 16, 4) < pipeline.closed_form("zb-h1", 16, 4)
    assert pipeline.unmet("zb-v", 4, 4) is None and "at least parallel.pp = 4" in pipeline.unmet("zb-v", 3, 4)
    assert pipeline.unmet("dualpipev", 8, 4) is None and "2 * parallel.pp = 8" in pipeline.unmet("dualpipev", 4, 4)
    assert pipeline.unmet("interleaved", 6, 4) is not None and pipeline.unmet("1f1b", 3, 4) is None


@pytest.mark.slow
def test_tiny_fixed_time_run_of_the_v_schedules(tmp_path):
    """pp 2, a 10 ms chunk op: about 2 s of sleep in all. dualpipev at m 2 < 2 pp is skipped, not run."""
    path = tmp_path / "pipeline.json"
    result = subprocess.run([sys.executable, "benchmarks/pipeline.py", "--pp", "2", "--schedules", "zb-v,dualpipev",
                             "--microbatches", "2,4", "--stage-cost", "sleep:20", "--hidden", "64", "--heads", "4",
                             "--layers", "4", "--seq", "32", "--vocab", "256", "--rounds", "1", "--warmup", "1",
                             "--json", str(path)], cwd=REPO, env=environment(), capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    skipped = r"^skipped dualpipev at m = 2, pp = 2: .*2 \* parallel\.pp = 4"
    assert re.search(skipped, result.stdout, re.M), result.stdout
    for schedule, m in (("zb-v", 2), ("zb-v", 4), ("dualpipev", 4)):  # the summary row: schedule, m, step ms, bubble
        assert re.search(rf"^{schedule}\s+{m}\s+\d+\s+\d+\.\d%", result.stdout, re.M), result.stdout
    configs = {(c["schedule"], c["microbatches"]): c for c in json.loads(path.read_text())["configs"]}
    assert sorted(configs) == [("dualpipev", 4), ("zb-v", 2), ("zb-v", 4)]
    for (schedule, m), c in configs.items():
        assert math.isfinite(c["measured_bubble"]) and 0 <= c["measured_bubble"] <= 1
        assert c["closed_form_bubble"] == pytest.approx(pipeline.closed_form(schedule, m, 2))
        assert c["sim_unit_bubble"] == pytest.approx(c["closed_form_bubble"])
        assert [r["in_flight"] for r in c["ranks"]] == [r["sim_in_flight"] for r in c["ranks"]]
        assert c["peak_in_flight"] == c["closed_form_peak"]
