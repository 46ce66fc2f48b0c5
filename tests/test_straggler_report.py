"""log.straggler_interval: one rank of 8 (PP2 x DP4) spins on the CPU in every forward-backward, and rank 0's
report names it, by coordinate, as the slowest rank against the median."""
import json
import os
import time

import pytest

from megatron_domino.config.loader import load_config
from tests.harness import run_ranks
from tests.training_runs import COMMON, REPO, TINY

pytestmark = pytest.mark.slow  # multi-rank training runs: the whole suite, not -m quick

SLOW_RANK, EXTRA_S = 5, 0.6  # rank 5 = tp 0, pp 1, dp 1 in tp-cp-dp-pp order


def _train(rank, world_size, run_dir):
    from megatron_domino.training.trainer import Trainer
    cfg = load_config(os.path.join(REPO, TINY["gpt"]), COMMON + [
        f"log.dir={run_dir}", "checkpoint.dir=null", "parallel.pp=2", "train.global_batch_size=16",
        "train.steps=4", "log.straggler_interval=2", "log.interval=100"])
    trainer = Trainer(cfg)
    forward_backward = trainer.engine.forward_backward

    def slow(*args, **kwargs):  # the test hook: extra CPU work on one rank only
        deadline = time.perf_counter() + EXTRA_S
        while time.perf_counter() < deadline:
            pass
        return forward_backward(*args, **kwargs)
    if rank == SLOW_RANK:
        trainer.engine.forward_backward = slow
    trainer.train()
    trainer.close()


def test_the_report_names_the_rank_that_computes_longest(tmp_path):
    run_ranks(_train, 8, str(tmp_path), timeout=300)
    with open(tmp_path / "stragglers.jsonl") as f:
        reports = [json.loads(line) for line in f]
    assert [r["step"] for r in reports] == [2, 4]
    for report in reports:
        slowest = report["slowest"][0]
        assert (slowest["rank"], slowest["tp"], slowest["pp"], slowest["dp"]) == (SLOW_RANK, 0, 1, 1), report
        # CPU time, not wall time: the 8 ranks share 2 cores, so the spin gets part of its wall time
        assert slowest["ratio_to_median"] > 1.5 and slowest["compute_ms"] >= 1000 * EXTRA_S / 2, report


def test_the_cuda_measure_leaves_out_nccl_kernels():
    """The profiler's events stood in: kernels count, NCCL kernels and host-side events do not."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from megatron_domino.training.straggler import compute_kernel_seconds

    def event(name, device, microseconds):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(elapsed_us=lambda: microseconds))
    events = [event("ampere_sgemm_128x64_nn", DeviceType.CUDA, 300), event("flash_fwd_kernel", DeviceType.CUDA, 200),
              event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", DeviceType.CUDA, 5000),
              event("aten::mm", DeviceType.CPU, 900)]
    assert compute_kernel_seconds(events) == 500e-6
