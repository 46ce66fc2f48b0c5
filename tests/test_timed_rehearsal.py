"""The real-device rehearsal with timed collectives (tools/rehearse.py --device, rehearsal/timed_rehearse.py) and the
Domino harness built on it (benchmarks/domino_timed.py): what they issue, predict and refuse."""
import json
import os
import subprocess
import sys

import pytest

from megatron_domino.pipeline.schedules import build_schedule
from megatron_domino.rehearsal.instruction_times import predict_step, stage_costs
from tests.fake_cuda import REPO, on_fake_cuda
from tests.tools import load_tool

TINY = ["parallel.tp=2", "parallel.pp=2"]  # tiny GPT at 8 ranks: tp 2 x pp 2 x dp 2
TINY_CONFIG = os.path.join(REPO, "configs", "tiny", "gpt.yaml")


def _tool(*args, timeout=300):
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "rehearse.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _tool_here(capsys, *args) -> tuple[int, str]:
    """tools/rehearse.py's main in this process (no interpreter start-up): (exit status, stderr)."""
    status = load_tool("rehearse").main(list(args))
    return status, capsys.readouterr().err


def _fake_collectives(overrides):
    """In the child: the fake rehearsal's collectives of ranks 0 and 4."""
    from megatron_domino.rehearsal.rehearse import rehearse
    result = rehearse(os.path.join(REPO, "configs/tiny/gpt.yaml"), 8, overrides, ranks=[0, 4])
    return [role["collectives"] for role in result["roles"]]


@pytest.mark.slow
def test_a_timed_cpu_run_issues_the_fake_rehearsals_collectives_and_writes_the_documented_fields(tmp_path):
    out = tmp_path / "timed.json"
    run = _tool("--config", "configs/tiny/gpt.yaml", "--world-size", "8", "--device", "cpu", "--link", "1,20",
                "--ranks", "0,4", "--steps", "2", *TINY, "--json", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["layout"] == {"tp": 2, "cp": 1, "pp": 2, "dp": 2, "ep": 1, "virtual_pp": 1}
    for role in result["roles"]:
        assert {"rank", "step_s", "comm_s", "exposed_comm_s", "peak_memory_gib", "planner_memory_gib",
                "planner_step_s", "mfu", "predicted_step_s"} <= set(role)
        assert {"tp", "dp", "pp"} <= set(role["comm_s"]) and role["mfu"] is None  # no MFU on the CPU
        assert all(0 <= role["exposed_comm_s"].get(g, 0) <= role["step_s"] for g in role["comm_s"])
        assert len(role["steps_s"]) == 2 and role["step_s"] > 0
        assert abs(role["peak_memory_gib"] / role["planner_memory_gib"] - 1) < 0.15
    fake = on_fake_cuda("tests.test_timed_rehearsal:_fake_collectives", TINY)
    assert [role["collectives"] for role in result["roles"]] == fake  # counts and bytes, group by group


def test_the_job_step_is_the_schedules_simulation_of_the_measured_instructions():
    class Parallel:
        pp, virtual_pp, pipeline_schedule = 4, 1, None
    measured = {0: {("F", 0): 1.0, ("B", 0): 2.0}, 3: {("F", 3): 1.5, ("B", 3): 3.0}}
    # 1F1B: (m + pp - 1) x (F + B) of the slowest stage when every stage took as long; here ranks 1 and 2 borrow
    # rank 0's times and rank 3 is slower, so the span is at least rank 3's own work plus the fill before it
    costs = stage_costs(measured, 4, 1, False)
    assert costs.forward == [1.0, 1.0, 1.5, 1.5] and costs.backward == [2.0, 2.0, 3.0, 3.0]
    uniform = {0: {("F", 0): 1.0, ("B", 0): 2.0}}
    for m in (4, 8):
        assert predict_step(Parallel, m, uniform, 0.25) == pytest.approx((m + 4 - 1) * 3.0 + 0.25)
        assert predict_step(Parallel, m, measured, 0.0) >= m * 4.5 + 3 * 1.0
    Parallel.pp = 1
    assert predict_step(Parallel, 6, uniform, 0.5) == pytest.approx(6 * 3.0 + 0.5)  # gradient accumulation
    assert build_schedule("1f1b", 4, 8)  # the schedules it simulates build (ZB and V schedules: test_pipeline_*)


def test_bad_input_is_refused_before_any_process_group_with_the_fix(monkeypatch, capsys):
    from megatron_domino.rehearsal import timed_rehearse

    def started(*args, **kwargs):
        raise AssertionError("a process group was started for a refused role")
    monkeypatch.setattr(timed_rehearse.dist, "init_process_group", started)
    monkeypatch.setattr(timed_rehearse, "free_bytes", lambda device: 24 * 2**30)
    with pytest.raises(timed_rehearse.RoleDoesNotFit, match=r"rank 0 \(pipeline stage 0\) needs .* GiB by the "
                                                           r"planner's estimate .* 24\.0 GiB free\. Fix: "):
        timed_rehearse.rehearse_timed(os.path.join(REPO, "configs/llama/llama3-70b.yaml"), 64, ranks=[0])
    status, err = _tool_here(capsys, "--config", TINY_CONFIG, "--world-size", "1", "--device", "cpu",
                             "--link", "nvlink5")
    assert status == 2 and "--link = 'nvlink5': not a link" in err and "Fix: e.g. --link nvlink4" in err
    status, err = _tool_here(capsys, "--config", TINY_CONFIG, "--world-size", "3", "--device", "cpu",
                             *TINY)
    assert status == 2 and "world size 3 is not divisible by tp * cp * pp = 4. Fix: " in err


def test_the_domino_harness_reports_every_mode_beside_sync_and_the_bound(tmp_path):
    out = tmp_path / "domino.json"
    run = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "domino_timed.py"), "--device", "cpu",
                          "--models", "cpu", "--tp", "2", "--layers", "1", "--steps", "1", "--warmup", "1",
                          "--modes", "sync,row-inter,column,nocomm", "--link", "0.05,10", "--json", str(out),
                          "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
                          "model.seq_length=32", "model.max_position_embeddings=32"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    case = json.loads(out.read_text())["cases"][0]
    assert [r["mode"] for r in case["modes"]] == ["sync", "row-inter", "column", "nocomm"]
    sync = case["modes"][0]
    assert sync["speedup"] == 1.0 and sync["hidden"] == 0.0 and "0.05 GB/s" in case["link"]
    assert "speed-up" in run.stdout and "hidden" in run.stdout
