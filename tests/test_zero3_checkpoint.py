"""ZeRO-3 checkpoints keep the layout-free format: each rank writes only its shard of the weights (no gather),
a resume at the same layout is bitwise, and the files load at ZeRO-1 on another layout and back."""
import os

import pytest

from tests.test_training import LAYOUT_222, _assert_close, assert_bitwise_resume
from tests.training_runs import losses, train

pytestmark = pytest.mark.slow  # multi-rank training runs: the whole suite, not -m quick

ZERO3_222 = [*LAYOUT_222, "optimizer.zero_stage=3"]
ZERO1_124 = ["parallel.tp=1", "parallel.pp=2", "parallel.dp=4", "parallel.domino=false", "optimizer.zero_stage=1"]


def test_zero3_resumes_bitwise_and_reshards_to_zero1_and_back(tmp_path):
    """The tiny GPT with Adam (no dropout: the layouts differ, and so would their masks), ZeRO-3 at tp 2 × pp 2
    × dp 2 with Domino, 8 steps, saved at 4 (in the background) and 8. Resumed from 4 at the same layout: steps
    5-8 and the step-8 files are the same bit for bit. Loaded at ZeRO-1, tp 1 × pp 2 × dp 4: steps 5-8 within
    1e-5, saved at 6; that loaded at ZeRO-3 (2, 2, 2) again: steps 7-8 within 1e-5 of the uninterrupted run.
    (Every run has the same train.steps: the LR schedule depends on it.)"""
    base = str(tmp_path / "base")
    common = ["train.steps=8", "checkpoint.keep=0"]
    train("gpt", 8, base, [*common, "checkpoint.interval=4", "checkpoint.async_save=true", *ZERO3_222])
    reference, step4 = losses(base), os.path.join(base, "checkpoints", "step_00000004")

    resumed = str(tmp_path / "resumed")
    train("gpt", 8, resumed, [*common, f"checkpoint.load={step4}", *ZERO3_222])
    assert_bitwise_resume(base, resumed, range(5, 9))

    zero1 = str(tmp_path / "zero1")
    train("gpt", 8, zero1, [*common, "checkpoint.interval=6", f"checkpoint.load={step4}", *ZERO1_124])
    moved = losses(zero1)
    assert sorted(moved) == [5, 6, 7, 8]
    _assert_close(moved, reference, [5, 6, 7, 8])

    back = str(tmp_path / "back")
    step6 = os.path.join(zero1, "checkpoints", "step_00000006")
    train("gpt", 8, back, [*common, f"checkpoint.load={step6}", "checkpoint.save_at_end=false", *ZERO3_222])
    returned = losses(back)
    assert sorted(returned) == [7, 8]
    _assert_close(returned, reference, [7, 8])
