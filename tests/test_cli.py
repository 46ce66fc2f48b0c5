"""The entry points' command line: config errors before any process group, schedule printing, dry run."""
import subprocess
import sys

import pytest

from tests.training_runs import REPO, environment


def _run(*args):
    return subprocess.run([sys.executable, "pretrain_gpt.py", *args], cwd=REPO, env=environment(),
                          capture_output=True, text=True, timeout=120)


def test_bad_config_exits_2_naming_key_value_rule_and_fix():
    result = _run("--config", "configs/tiny/gpt.yaml", "parallel.tp=3")
    assert result.returncode == 2
    assert "parallel.tp" in result.stderr and "Fix:" in result.stderr
    typo = _run("--config", "configs/tiny/gpt.yaml", "train.step=3")
    assert typo.returncode == 2 and "did you mean 'steps'" in typo.stderr


@pytest.mark.slow
def test_print_schedule_shows_every_pipeline_rank():
    result = _run("--config", "configs/tiny/gpt.yaml", "--print-schedule", "parallel.pp=4", "parallel.dp=1",
                  "--world-size", "4")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("rank ") and " | " in line]
    assert len(rows) == 4 and "F0" in rows[0] and "B7" in rows[3]


def test_print_schedule_is_the_runs_own_schedule():
    """The kind the config runs (ZB-H1 here, not 1F1B) and the micro-batches the trainer counts: per DP rank,
    where the context-parallel ranks of a sequence share its batch (cp 2 at world 4 leaves dp 1: 8, not 4)."""
    result = _run("--config", "configs/tiny/gpt.yaml", "--print-schedule", "parallel.pp=2", "parallel.cp=2",
                  "parallel.pipeline_schedule=zb-h1", "--world-size", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("zb-h1: pp=2 microbatches=8 ")
    rows = [line for line in result.stdout.splitlines() if line.startswith("rank ") and " | " in line]
    assert len(rows) == 2 and "W7" in rows[0] and "I7" in rows[1]


def test_dry_run_prints_rank_map_without_a_process_group():
    result = _run("--config", "configs/gpt/175b.yaml", "--dry-run", "--world-size", "1024")
    assert result.returncode == 0, result.stderr
    assert "world 1024 = tp 8 x cp 1 x pp 16 x dp 8" in result.stdout


def test_eval_only_without_a_checkpoint_is_refused():
    result = _run("--config", "configs/tiny/gpt.yaml", "--eval-only", "data.mock=true")
    assert result.returncode == 2 and "checkpoint.load" in result.stderr
