"""FP8 through the trainer: a delayed-scaling run saved and resumed is bitwise the uninterrupted run (the amax
histories are in the checkpoint), an FP8 checkpoint loads into a run without FP8 and back, and another layout resumes
the histories."""
import os

import pytest
import torch

from tests.test_training import _stored, assert_bitwise_resume
from tests.training_runs import losses, train

pytestmark = pytest.mark.slow

LAYOUT = ["parallel.tp=2", "parallel.dp=1", "model.fp8=delayed", "optimizer.zero_stage=1", "train.global_batch_size=4"]


def test_delayed_fp8_resumes_bitwise_and_loads_without_fp8(tmp_path):
    base, resumed, plain = str(tmp_path / "base"), str(tmp_path / "resumed"), str(tmp_path / "plain")
    train("gpt", 2, base, ["train.steps=8", "checkpoint.interval=4", "checkpoint.keep=0", *LAYOUT])
    step4 = os.path.join(base, "checkpoints", "step_00000004")
    histories = _stored(base, 4, prefix="fp8/")
    assert len(histories) == 16 and all(h.shape == (16, 3) for h in histories.values())  # 4 layers x 4 linears
    assert all(h[:4].gt(0).all() and not h[4:].any() for h in histories.values())  # 4 steps recorded
    train("gpt", 2, resumed, ["train.steps=8", f"checkpoint.load={step4}", *LAYOUT])
    assert_bitwise_resume(base, resumed, range(5, 9))
    for name, history in _stored(base, 8, prefix="fp8/").items():
        assert torch.equal(history, _stored(resumed, 8, prefix="fp8/")[name]), name
    train("gpt", 1, plain, ["train.steps=6", f"checkpoint.load={step4}", "model.fp8=null",
                            "train.global_batch_size=4"])
    assert sorted(losses(plain)) == [5, 6] and not _stored(plain, 6, prefix="fp8/")
    # another layout (tp 1) finds the histories under their layout-free names and goes on from them
    resharded = str(tmp_path / "resharded")
    train("gpt", 1, resharded, ["train.steps=6", f"checkpoint.load={step4}", "model.fp8=delayed",
                                "train.global_batch_size=4"])
    for name, history in _stored(resharded, 6, prefix="fp8/").items():
        assert torch.equal(history[2:], histories[name][:-2]) and history[:2].gt(0).all(), name
    # and back: the checkpoint trained without FP8 into delayed FP8, which starts its histories (a calibration step)
    back = str(tmp_path / "back")
    train("gpt", 1, back, ["train.steps=7", f"checkpoint.load={plain}/checkpoints/step_00000006", "model.fp8=delayed",
                           "train.global_batch_size=4"])
    assert all(h[0].gt(0).all() and not h[1:].any() for h in _stored(back, 7, prefix="fp8/").values())
