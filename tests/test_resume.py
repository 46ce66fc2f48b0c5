"""A resume is bitwise: saved at step 3 of 6, resumed at the same layout, steps 4-6 give the same losses and the step-6
weights and optimizer state are the same, bit for bit, across the schedules, sharding and parallelisms whose state a
checkpoint must carry. Dropout is on (attention's too, but under CP, which refuses it), so every RNG stream must
come back; 4 ranks each:
- tp 2 x dp 2 with Domino, ZeRO-2, saved in the background: the TP stream, the reduced gradient shards;
- pp 2 x dp 2 interleaved (virtual pp 2), fp16: each stage's default stream, the loss scaler (it doubles every 2
  steps, so its growth count at the save decides when it next grows);
- cp 2 x pp 2 under ZB-H1 with packed documents: the split backward, the ring;
- the tiny Mixtral at pp 2 x dp 2 x ep 2 under ZB-V: the V, the experts' shards and their routing."""
import os

import pytest

from tests.test_training import DOCUMENTS, DROPOUT, assert_bitwise_resume
from tests.training_runs import train

pytestmark = pytest.mark.slow  # multi-rank training runs

LAYOUTS = {
    "tp2-dp2-domino-zero2": ("gpt", ["parallel.tp=2", "parallel.dp=2", "parallel.domino=true",
                                     "optimizer.zero_stage=2", "checkpoint.async_save=true", *DROPOUT]),
    "pp2-dp2-interleaved-fp16": ("gpt", ["parallel.pp=2", "parallel.dp=2", "parallel.virtual_pp=2", "train.fp16=true",
                                         "optimizer.loss_scale_window=2", "optimizer.zero_stage=1", *DROPOUT]),
    "cp2-pp2-zb-h1-documents": ("llama", ["parallel.cp=2", "parallel.pp=2", "parallel.pipeline_schedule=zb-h1",
                                          "model.hidden_dropout=0.1", *DOCUMENTS]),
    "mixtral-pp2-dp2-ep2-zb-v": ("mixtral", ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2",
                                             "parallel.pipeline_schedule=zb-v", "model.hidden_dropout=0.1"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_resume_is_bitwise(tmp_path, layout):
    family, overrides = LAYOUTS[layout]
    base, resumed = str(tmp_path / "base"), str(tmp_path / "resumed")
    train(family, 4, base, ["train.steps=6", "checkpoint.interval=3", "checkpoint.keep=0", *overrides])
    step3 = os.path.join(base, "checkpoints", "step_00000003")
    assert sorted(f for f in os.listdir(step3) if f.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    train(family, 4, resumed, ["train.steps=6", f"checkpoint.load={step3}", *overrides])
    assert_bitwise_resume(base, resumed, range(4, 7))
