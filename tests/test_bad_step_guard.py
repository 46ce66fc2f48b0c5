"""train.on_bad_step: a NaN gradient on one rank at step K is skipped by every rank, or stops every rank with a
checkpoint of step K - 1; a loss spike above spike_factor x the running median is refused. One spawn of 4 ranks
(TP2 x PP2) runs both actions. ``rerun``: a fault in the first attempt only is transient (the run equals a run
without it bit for bit, dropout on); one in both attempts is the data's (skipped or stopped, documents named)."""
import json
import math
import os

import pytest
import torch

from megatron_domino.config.loader import load_config
from megatron_domino.training.guard import BadStepError, BadStepGuard
from tests.harness import run_ranks
from tests.training_runs import COMMON, REPO, TINY

pytestmark = pytest.mark.slow  # multi-rank training runs: the whole suite, not -m quick

BAD_STEP, POISONED_RANK = 3, 1  # rank 1: TP rank 1 of the first stage, which holds its own weight shards


def _checksum(trainer) -> float:
    return sum(p.detach().double().sum().item() for chunk in trainer.chunks for p in chunk.parameters())


def _trainer(rank, run_dir, action, name=None, poisoned_attempts=(1,), overrides=()):
    from megatron_domino.training.trainer import Trainer
    name = name or action
    cfg = load_config(os.path.join(REPO, TINY["gpt"]), COMMON + [
        f"log.dir={run_dir}/{name}", f"checkpoint.dir={run_dir}/{name}/checkpoints", "parallel.tp=2",
        "parallel.pp=2", "train.global_batch_size=8", "train.steps=5", f"train.on_bad_step={action}", *overrides])
    trainer = Trainer(cfg)
    optimizer_step, sums, attempts = trainer.optimizer.step, {}, []

    def step(lr, accept=None):  # the test hook: poison this rank's gradient before step BAD_STEP's update
        attempts.append(trainer.step + 1)
        if rank == POISONED_RANK and trainer.step + 1 == BAD_STEP and attempts.count(BAD_STEP) in poisoned_attempts:
            for fragment in trainer.optimizer.fragments:
                fragment.grad.fill_(float("nan"))
        stepped = optimizer_step(lr, accept)
        sums[trainer.step + 1] = _checksum(trainer)
        return stepped
    trainer.optimizer.step = step
    return trainer, sums


def _both_actions(rank, world_size, run_dir):
    trainer, sums = _trainer(rank, run_dir, "skip")
    trainer.train()
    skipped = (trainer.guard.skipped, trainer.optimizer.steps, sums, trainer.step)
    trainer.close()
    trainer, _ = _trainer(rank, run_dir, "stop")
    with pytest.raises(BadStepError) as stopped:
        trainer.train()
    trainer.close()
    torch.distributed.barrier()  # rank 0 hosts the store here: it stays until every rank has left the save
    return skipped, str(stopped.value)


def test_a_nan_on_one_rank_is_skipped_or_stops_every_rank(tmp_path):
    results = run_ranks(_both_actions, 4, str(tmp_path), timeout=300)
    for rank, ((skipped, updates, sums, step), message) in enumerate(results):
        assert (skipped, updates, step) == (1, 4, 5), f"rank {rank}"
        assert sums[BAD_STEP] == sums[BAD_STEP - 1] and sums[BAD_STEP + 1] != sums[BAD_STEP], f"rank {rank}"
        assert all(math.isfinite(value) for value in sums.values()), f"rank {rank}: {sums}"
        assert f"bad step {BAD_STEP}: grad norm is nan, first seen on rank {POISONED_RANK}" in message
        assert "after saving the last good step" in message
    with open(tmp_path / "stop" / "checkpoints" / "latest") as f:
        assert json.load(f)["step"] == BAD_STEP - 1
    bad = [json.loads(line) for line in open(tmp_path / "skip" / "metrics.jsonl") if '"bad_step"' in line]
    assert [(r["step"], r["action"]) for r in bad] == [(BAD_STEP, "skip")]
    last = [json.loads(line) for line in open(tmp_path / "skip" / "metrics.jsonl")][-1]
    assert last["step"] == 5 and last["skipped_steps"] == 1


def test_a_spike_above_the_running_median_is_refused_and_not_remembered():
    guard = BadStepGuard("skip", spike_factor=2.0, spike_window=3, rank=0, world_size=1)
    norm, local = torch.tensor(1.0), torch.tensor(1.0)
    verdicts = [guard.judge(step, torch.tensor(loss))(norm, local)
                for step, loss in enumerate([4.0, 3.0, 3.5, 7.5, 6.5, 3.25], start=1)]
    assert verdicts == [True, True, True, False, True, True]  # 7.5 > 2 x 3.5; 6.5 is not above 2 x 3.5
    assert guard.skipped == 1 and list(guard.recent) == [3.5, 6.5, 3.25]
    assert guard.judge(7, torch.tensor(float("inf")))(norm, local) is False
    assert guard.problem == "bad step 7: loss is inf, first seen on every rank (the global loss)"


RERUN = ["model.hidden_dropout=0.1"]  # a rerun must repeat the first attempt's dropout masks


def _reruns(rank, world_size, run_dir):
    """Without a fault; a fault in the first attempt only; in both, skipped; in both, stopped."""
    sums = {}
    for name, poisoned, after in (("clean", (), "stop"), ("transient", (1,), "stop"), ("data", (1, 2), "skip")):
        trainer, sums[name] = _trainer(rank, run_dir, "rerun", name, poisoned,
                                       [*RERUN, f"train.on_bad_step_after_rerun={after}"])
        trainer.train()
        sums[name] = (sums[name], trainer.guard.skipped, trainer.step)
        trainer.close()
    trainer, _ = _trainer(rank, run_dir, "rerun", "stopped", (1, 2), RERUN)
    with pytest.raises(BadStepError) as stopped:
        trainer.train()
    trainer.close()
    torch.distributed.barrier()
    return sums, str(stopped.value)


def _bad_steps(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"bad_step"' in line]


def test_a_rerun_tells_a_transient_fault_from_the_data(tmp_path):
    results = run_ranks(_reruns, 4, str(tmp_path), timeout=400)
    for rank, (sums, message) in enumerate(results):
        clean, transient, data = sums["clean"], sums["transient"], sums["data"]
        assert transient == clean and clean[1:] == (0, 5), f"rank {rank}"  # bit for bit, nothing skipped
        assert data[1:] == (1, 5) and data[0][BAD_STEP] == data[0][BAD_STEP - 1], f"rank {rank}"  # not applied
        assert data[0][BAD_STEP + 1] != data[0][BAD_STEP], f"rank {rank}"
        assert "reproduced it: the data or the model" in message and "on_bad_step_after_rerun=stop" in message
        assert "samples 16..23 of the training set, documents mock:0:16" in message
    (record,) = _bad_steps(tmp_path / "transient")
    assert record["action"] == "transient" and record["step"] == BAD_STEP
    assert f"did not reproduce it: a transient fault on rank {POISONED_RANK}, host " in record["problem"]
    (record,) = _bad_steps(tmp_path / "data")
    assert record["action"] == "skip" and "reproduced it" in record["problem"]
    with open(tmp_path / "stopped" / "checkpoints" / "latest") as f:
        assert json.load(f)["step"] == BAD_STEP - 1


V_SCHEDULE = ["parallel.virtual_pp=2", "parallel.pipeline_schedule=dualpipev"]  # m = 4 = 2 pp


def _v_reruns(rank, world_size, run_dir):
    """Under DualPipeV (split backwards, W's deferred across micro-batches): clean, a transient fault rerun,
    and the data's fault skipped."""
    sums = {}
    for name, poisoned, after in (("v-clean", (), "stop"), ("v-transient", (1,), "stop"), ("v-data", (1, 2), "skip")):
        trainer, found = _trainer(rank, run_dir, "rerun", name, poisoned,
                                  [*RERUN, *V_SCHEDULE, f"train.on_bad_step_after_rerun={after}"])
        assert trainer.engine.stage.v_shape and trainer.engine.holds_loss == (trainer.state.pp_rank == 0)
        trainer.train()
        sums[name] = (found, trainer.guard.skipped, trainer.step)
        trainer.close()
    return sums


def test_the_v_schedules_rerun_a_step_bit_for_bit_and_skip_one(tmp_path):
    """A rerun starts the step's program again: nothing of the first attempt (a pending W, a held gradient)
    may leak into it."""
    results = run_ranks(_v_reruns, 4, str(tmp_path), timeout=400)
    for rank, sums in enumerate(results):
        clean, transient, data = sums["v-clean"], sums["v-transient"], sums["v-data"]
        assert transient == clean and clean[1:] == (0, 5), f"rank {rank}"
        assert data[1:] == (1, 5) and data[0][BAD_STEP] == data[0][BAD_STEP - 1], f"rank {rank}"
        assert data[0][BAD_STEP + 1] != data[0][BAD_STEP], f"rank {rank}"
    (record,) = _bad_steps(tmp_path / "v-transient")
    assert record["action"] == "transient" and record["step"] == BAD_STEP
