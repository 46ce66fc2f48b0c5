"""The entry points' command line: config errors before any process group, schedule printing, dry run."""
import subprocess
import sys

import pytest

from tests.training_runs import REPO, environment


def _run(*args):
    return subprocess.run([sys.executable, "pretrain_gpt.py", *args], cwd=REPO, env=environment(),
                          capture_output=True, text=True, timeout=120)


# The entry point with a hook on init_process_group: a group started (even if destroyed again) prints STARTED.
_HOOKED = """
import sys
import torch.distributed as dist
from megatron_domino.training import cli

def started(*args, **kwargs):
    print("STARTED", flush=True)
    raise SystemExit(7)

dist.init_process_group = started
for argv in sys.argv[1:]:
    print("STATUS", cli.main(argv.split()), flush=True)
"""


def test_bad_configs_are_refused_before_any_process_group_starts():
    """pretrain_gpt.py's main with a bad layout, a typo, a bad MoE setting and --eval-only without a checkpoint:
    each exits 2 naming the key, the rule and the fix, and no process group was started for it."""
    cases = ["parallel.tp=3", "train.step=3", "model.num_experts=4 model.moe_topk=5", "--eval-only"]
    done = subprocess.run([sys.executable, "-c", _HOOKED,
                           *[f"--config configs/tiny/gpt.yaml data.mock=true {case}" for case in cases]],
                          cwd=REPO, env=environment(), capture_output=True, text=True, timeout=120, check=False)
    assert "STARTED" not in done.stdout and done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.split() == ["STATUS", "2"] * len(cases), done.stdout
    errors = done.stderr.split("config error: ")[1:]
    assert len(errors) == len(cases), done.stderr
    for error, key in zip(errors, ("parallel.tp", "train.step", "model.moe_topk", "checkpoint.load")):
        assert key in error and "Fix:" in error, (key, error)
    assert "did you mean 'steps'" in errors[1]


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
