"""Tensorwise FP8 weight scales, one all-reduce per block and step (``fp8/weight_scales.py``): at tp 2 with
Domino (2 μ-chunks, 4 micro-batches, 2 blocks), the step's MAX all-reduces of weight amaxes go from one per
weight use (4 linears x 2 blocks x 2 chunks x 4 micro-batches) to one stacked one per block, and training is
bit for bit what it was with a reduction per use (and with the FP8 weight copies made once per step: the same
numbers as at every use)."""
import contextlib
import sys

import pytest
import torch
import torch.distributed as dist

from tests import parity
from tests.harness import run_ranks
from tests.test_context_parallel import STEPS, _layout, _train
from tests.test_fp8_parity import fp8
from tests.test_pipeline import GLOBAL_BATCH, GPT, MICRO_BATCH

pytestmark = pytest.mark.slow


def _counted_run(world_size, cfg):
    """(losses, weights, FP8's MAX all-reduces of one element, of more)."""
    counts, original = [0, 0], dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op == dist.ReduceOp.MAX and sys._getframe(1).f_globals["__name__"].startswith("megatron_domino.fp8."):
            counts[tensor.numel() > 1] += 1
        return original(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting
    try:
        losses, weights = _train(world_size, cfg, False)
    finally:
        dist.all_reduce = original
    return losses, weights, counts


def _check(rank, world_size):
    cfg = _layout(fp8(GPT, "tensorwise"), cp=1, tp=2, domino=True)[0]
    grouped = _counted_run(world_size, cfg)
    fixed = parity.fixed_for_the_step  # held around each step's run, as the trainer holds it
    parity.fixed_for_the_step = lambda chunks, **kept: contextlib.nullcontext()  # every use its own
    try:
        per_use = _counted_run(world_size, cfg)
    finally:
        parity.fixed_for_the_step = fixed
    assert grouped[0] == per_use[0]
    for name, weight in grouped[1].items():
        assert torch.equal(weight, per_use[1][name]), name
    uses = 4 * GPT.num_layers * cfg.parallel.domino_chunks * (GLOBAL_BATCH // MICRO_BATCH) * STEPS
    assert per_use[2] == [per_use[2][0], 0] and grouped[2] == [per_use[2][0] - uses, GPT.num_layers * STEPS], \
        (grouped[2], per_use[2], uses)
    return grouped[2], per_use[2]


def test_tensorwise_weight_scales_take_one_all_reduce_per_block_and_step():
    run_ranks(_check, 2, timeout=300)
