"""A save costs each rank at most its own state in extra host memory: nothing is gathered.

At tp 2 x dp 2 with ZeRO-1 a rank owns half of every weight and a quarter of the fp32 masters and Adam
moments: 4/2 + 12/4 = 5 bytes per parameter of its stage. Gathering the stage, as a full-size format must,
costs 16 bytes per parameter. The peak resident memory of each rank is measured around a synchronous
and an asynchronous save (Linux: the high-water mark is reset through /proc/self/clear_refs) and must stay
within the rank's own share plus a small constant, well below the gather.
"""
import gc
import os
from dataclasses import replace

import pytest

from megatron_domino.config.loader import load_config
from tests.harness import run_ranks
from tests.training_runs import COMMON, REPO, TINY

pytestmark = pytest.mark.slow  # multi-rank training runs: the whole suite, not -m quick

CONSTANT = 16 * 2**20  # DCP's plans and index, pickling buffers, allocator slack
LAYOUT = ["parallel.tp=2", "parallel.pp=1", "parallel.dp=2", "optimizer.zero_stage=1"]
MODEL = ["model.hidden_size=512", "model.ffn_hidden_size=2048", "model.num_attention_heads=8", "model.vocab_size=1024",
         "model.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=1"]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])


def _peak_during(action) -> int:
    """Bytes of resident memory above the starting point at the peak of ``action()``."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from the current resident size
    start = _status_kib("VmRSS")
    action()
    return (_status_kib("VmHWM") - start) * 1024


def _own_state_bytes(trainer) -> int:
    weights = sum(p.numel() * p.element_size() for chunk in trainer.chunks for p in chunk.parameters())
    optimizer = trainer.optimizer.memory_report()
    return weights + optimizer["master_bytes"] + optimizer["optimizer_state_bytes"]


def _saves(rank, world_size, run_dir):
    from megatron_domino.training.checkpoint import Checkpointer
    from megatron_domino.training.trainer import Trainer
    cfg = load_config(os.path.join(REPO, TINY["gpt"]), COMMON + LAYOUT + MODEL + [
        f"log.dir={run_dir}", f"checkpoint.dir={run_dir}/ckpt", "train.steps=3", "checkpoint.keep=0"])
    trainer = Trainer(cfg)
    trainer.train_step()
    trainer.step = 1
    stage_params = sum(p.numel() for chunk in trainer.chunks for p in chunk.parameters()) * 2  # x tp
    background = Checkpointer(replace(cfg, checkpoint=replace(cfg.checkpoint, async_save=True)), trainer.state,
                              trainer.rng, trainer.run_id)
    sync_peak = _peak_during(trainer.save)
    trainer.step = 2

    def save_in_background():
        background.save(cfg.checkpoint.dir, 2, chunks=trainer.chunks, optimizer=trainer.optimizer,
                        lr_schedule=trainer.lr_schedule, consumed_samples=0, keep=0)
        background.wait()

    async_peak = _peak_during(save_in_background)
    own = _own_state_bytes(trainer)
    trainer.close()
    return {"sync": sync_peak, "async": async_peak, "own": own, "gather": 16 * stage_params}


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_a_save_costs_at_most_the_ranks_own_state(tmp_path):
    for rank, measured in enumerate(run_ranks(_saves, 4, str(tmp_path), timeout=240)):
        print(f"rank {rank}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in measured.items()))
        own, gather = measured["own"], measured["gather"]
        assert own + CONSTANT < gather / 2, measured  # the bound below discriminates
        for mode in ("sync", "async"):
            assert measured[mode] <= own + CONSTANT, (rank, mode, measured)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step_00000001", "step_00000002"]
