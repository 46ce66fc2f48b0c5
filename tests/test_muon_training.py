"""Muon and low-precision state through the trainer: a resume is bitwise (dropout on), the state is layout-free
(saved at one layout and ZeRO stage, loaded at others, saved again: the same tensors), and a checkpoint crosses
between AdamW and Muon, the state it lacks starting afresh, as the log says."""
import os

import pytest
import torch

from tests.test_training import DROPOUT, _stored, assert_bitwise_resume
from tests.training_runs import losses, train

pytestmark = pytest.mark.slow  # multi-rank training runs

MUON = ["optimizer.name=muon", "optimizer.lr=0.02", "optimizer.adamw_lr=3e-3"]
BF16_STATES = ["train.bf16=true", "optimizer.master_dtype=bf16", "optimizer.moments_dtype=bf16",
               "model.attention_backend=auto"]


@pytest.mark.parametrize("optimizer, layout", [
    (MUON, ["parallel.tp=2", "parallel.pp=1", "parallel.dp=2", "parallel.domino=true", "optimizer.zero_stage=1"]),
    (BF16_STATES, ["parallel.tp=1", "parallel.pp=2", "parallel.dp=2", "optimizer.zero_stage=2"]),
    (MUON + BF16_STATES + ["optimizer.master_rounding=compensated"],
     ["parallel.tp=1", "parallel.pp=1", "parallel.dp=4", "optimizer.zero_stage=3"])],
    ids=["muon-tp2-dp2", "adamw-bf16-masters-stochastic-moments-pp2-dp2", "muon-bf16-compensated-zero3-dp4"])
def test_resume_is_bitwise(tmp_path, optimizer, layout):
    """Save at step 4 of 8 with dropout on; the resumed steps 5-8 have the same losses and the step-8 weights and
    optimizer state (masters, moments, Muon's momentum, compensations) are the same, bit for bit."""
    base, resumed = str(tmp_path / "base"), str(tmp_path / "resumed")
    common = ["train.steps=8", *DROPOUT, *optimizer, *layout]
    train("gpt", 4, base, [*common, "checkpoint.interval=4", "checkpoint.keep=0"])
    train("gpt", 4, resumed, [*common, f"checkpoint.load={base}/checkpoints/step_00000004"])
    assert_bitwise_resume(base, resumed, range(5, 9))
    names = set(_stored(base, 8, "optim/"))
    if "optimizer.name=muon" in optimizer:
        assert any(n.endswith("/muon_momentum") for n in names) and any(n.endswith("/exp_avg") for n in names)
    if "optimizer.master_rounding=compensated" in optimizer:
        assert any(n.endswith("/master_compensation") for n in names)


def _reloaded(run: str, source: str, layout: list[str], optimizer: list[str]) -> str:
    """Load ``source`` at ``layout`` and save it again at once (no step taken): the run's output."""
    result = train("gpt", 4, run, ["train.steps=4", f"checkpoint.load={source}", "checkpoint.save_at_end=true",
                                   *optimizer, *layout])
    return result.stdout


def test_state_is_layout_free_and_crosses_between_adamw_and_muon(tmp_path):
    """Muon with bf16 moments saved at pp 2 x dp 2 (ZeRO-1) loads at dp 4 (ZeRO-3) and tp 2 x dp 2 (ZeRO-2) and is
    saved again unchanged. An AdamW checkpoint loads into Muon (fresh momentum, said in the log; Adam's moments of
    the embeddings and norms kept) and Muon's back into AdamW (fresh moments for the matrices), and both train on."""
    states = MUON + ["optimizer.moments_dtype=bf16"]
    base = str(tmp_path / "base")
    train("gpt", 4, base, ["train.steps=4", "checkpoint.interval=4", "parallel.tp=1", "parallel.pp=2",
                           "parallel.dp=2", "optimizer.zero_stage=1", *states])
    saved = _stored(base, 4, "optim/")
    assert saved["layers.0.attention.qkv.weight/muon_momentum"].dtype == torch.bfloat16
    source = os.path.join(base, "checkpoints", "step_00000004")
    for layout in (["parallel.tp=1", "parallel.pp=1", "parallel.dp=4", "optimizer.zero_stage=3"],
                   ["parallel.tp=2", "parallel.pp=1", "parallel.dp=2", "optimizer.zero_stage=2",
                    "parallel.domino=true"]):
        run = str(tmp_path / "-".join(layout))
        _reloaded(run, source, layout, states)
        again = _stored(run, 4, "optim/")
        assert sorted(again) == sorted(saved)
        for name, tensor in saved.items():
            assert torch.equal(tensor, again[name]), (layout, name)

    adamw = str(tmp_path / "adamw")
    train("gpt", 4, adamw, ["train.steps=4", "checkpoint.interval=4", "parallel.dp=4"])
    into_muon = str(tmp_path / "into-muon")
    out = train("gpt", 4, into_muon, ["train.steps=6", f"checkpoint.load={adamw}/checkpoints/step_00000004",
                                      "parallel.dp=4", *MUON]).stdout
    assert "holds no optimizer state ['muon_momentum']" in out and "start afresh" in out
    kept = _stored(adamw, 4, "optim/")["embedding.word_embeddings.weight/exp_avg"]
    assert kept.abs().sum() > 0
    assert sorted(losses(into_muon)) == [5, 6]
    back = str(tmp_path / "back")
    out = train("gpt", 4, back, ["train.steps=8", f"checkpoint.load={into_muon}/checkpoints/step_00000006",
                                 "parallel.dp=4"]).stdout
    assert "holds no optimizer state ['exp_avg', 'exp_avg_sq']" in out
    assert sorted(losses(back)) == [7, 8]
