"""FP8 trains as well as bf16: the quick-start GPT (configs/tiny/gpt.yaml) on the quick-start corpus, one process,
fixed seed. The final loss (the mean of the last steps' losses, which averages out the batch-to-batch noise of a
single step, several percent here) of FP8 tensorwise and blockwise is within a tolerance of bf16's; and FP8 ran: from
the first step on, each FP8 run's losses are not bf16's (with ``model.fp8`` a no-op, the same seed gives bf16's
losses exactly, and the test fails). The three runs go side by side (one thread each), without the quick start's
periodic evaluation.

The claim (docs/fp8.md) is 300 steps within 1.5% over the last 50, in the sweep tier (4 minutes on 2 cores); the
default run holds 80 steps of the same runs to ten times the difference measured there (35 s)."""
import json
import os
import subprocess
import sys

import pytest

from tests.training_runs import REPO, environment

pytestmark = pytest.mark.slow



def _start(tmp_path, name, data, overrides, steps) -> subprocess.Popen:
    run = tmp_path / name
    config = os.path.join(REPO, "configs/tiny/gpt.yaml")
    args = [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), "--config", config,
            f"tokenizer.model={data}/tokenizer.model", f"data.path=[{data}/corpus_text_document]", f"log.dir={run}",
            f"checkpoint.dir={run}/checkpoints", f"checkpoint.interval={steps}", "log.tensorboard=false",
            f"train.steps={steps}", "train.bf16=true", "log.interval=1", "train.seed=1234", "train.eval_interval=0",
            *overrides]
    with open(tmp_path / f"{name}.err", "w") as errors:  # a file: three pipes waited for in turn could fill up
        return subprocess.Popen(args, cwd=REPO, env=environment(), stdout=subprocess.DEVNULL, stderr=errors)


def _losses(tmp_path, name, process: subprocess.Popen, steps) -> list[float]:
    try:
        process.wait(timeout=600)
    finally:
        process.kill()
    assert process.returncode == 0, (name, (tmp_path / f"{name}.err").read_text()[-3000:])
    with open(tmp_path / name / "metrics.jsonl", encoding="utf-8") as f:
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r and "split" not in r]
    assert len(losses) == steps
    return losses


def _compare(tmp_path, steps, tail, tolerance):
    data = tmp_path / "data"
    subprocess.run([sys.executable, os.path.join(REPO, "tools/prepare_quickstart_data.py"), "--output-dir", str(data)],
                   cwd=REPO, env=environment(), check=True, capture_output=True, timeout=300)
    runs = {"bf16": _start(tmp_path, "bf16", data, [], steps)}
    for recipe in ("tensorwise", "blockwise"):
        runs[recipe] = _start(tmp_path, recipe, data, [f"model.fp8={recipe}", "model.fp8_block_size=32"], steps)
    losses = {name: _losses(tmp_path, name, process, steps) for name, process in runs.items()}
    final = {name: sum(run[-tail:]) / tail for name, run in losses.items()}
    bf16 = final["bf16"]
    for recipe in ("tensorwise", "blockwise"):
        assert losses[recipe][0] != losses["bf16"][0], (recipe, "the first step's loss is bf16's: FP8 did not run")
        fp8 = final[recipe]
        assert abs(fp8 - bf16) <= tolerance * bf16, (recipe, fp8, bf16)
        print(f"{recipe}: {fp8:.4f} vs bf16 {bf16:.4f} ({(fp8 - bf16) / bf16:+.2%})")


@pytest.mark.sweep
def test_fp8_tensorwise_and_blockwise_train_within_1_5_percent_of_bf16(tmp_path):
    _compare(tmp_path, steps=300, tail=50, tolerance=0.015)


def test_fp8_tensorwise_and_blockwise_stay_within_half_a_percent_of_bf16_over_80_steps(tmp_path):
    """Measured (torch 2.13, CPU): tensorwise +0.01%, blockwise +0.05% of bf16 over the last 20 of 80 steps."""
    _compare(tmp_path, steps=80, tail=20, tolerance=0.005)
