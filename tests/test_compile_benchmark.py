"""benchmarks/compile_speed.py: its arithmetic, and one tiny run of both layouts end to end (the plumbing only: the
numbers of so small a model mean nothing, except that compiled and eager compute the same losses)."""
import json
import os
import subprocess
import sys

import pytest

from tests.training_runs import REPO, environment

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import compile_speed  # noqa: E402


@pytest.mark.quick
def test_medians_skip_the_warm_up_and_the_ratio_is_compiled_over_eager_throughput():
    args = compile_speed.parse_args(["--seq", "4", "--micro-batch", "2", "--rounds", "3", "--warmup", "1"])
    seconds = {"eager": [9.0, 1.0, 2.0, 3.0], "compiled": [30.0, 1.0, 1.0, 1.0]}
    losses = {"eager": [2.0, 1.0, 1.0, 1.0], "compiled": [2.0, 1.0, 1.0, 1.000001]}
    result = compile_speed.summarize(args, seconds, losses)
    assert result["median_s"] == {"eager": 2.0, "compiled": 1.0}
    assert result["tokens_per_s"] == {"eager": 4.0, "compiled": 8.0} and result["ratio"] == 2.0
    assert result["first_step_s"]["compiled"] == 30.0
    assert result["loss_max_rel_deviation"] == pytest.approx(1e-6)
    assert result["loss_first_rel_deviation"] == 0.0
    assert "| tp1 | 4 | 8 | 2.000 | 2000 | 1000 | 30.0 | 0e+00 / 1e-06 |" in compile_speed.report([result])
    with pytest.raises(SystemExit):
        compile_speed.parse_args(["--layouts", "tp1,tp3"])


@pytest.mark.slow
def test_tiny_run_of_both_layouts(tmp_path):
    """tp1 (a bare process) and tp2 with Domino (torchrun, 2 ranks): the table, and the same losses in both modes."""
    path = tmp_path / "compile_speed.json"
    result = subprocess.run([sys.executable, "benchmarks/compile_speed.py", "--hidden", "64", "--heads", "4",
                             "--layers", "2", "--seq", "32", "--vocab", "256", "--rounds", "1", "--warmup", "1",
                             "--json", str(path)], cwd=REPO, env=environment(), capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "| tp1 |" in result.stdout and "| tp2 Domino |" in result.stdout
    layouts = json.loads(path.read_text())["layouts"]
    assert [r["layout"] for r in layouts] == ["tp1", "tp2"]
    assert all(r["loss_max_rel_deviation"] < 1e-5 for r in layouts), [r["loss_max_rel_deviation"] for r in layouts]
