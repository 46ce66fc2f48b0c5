"""CPU offload's host step (``optim/host_step.py``) runs behind the next forward: the forward starts while the host
thread still steps the last bucket, each bucket is completed by the forward's reads (none is left for the end of
the step), and the result is the same arithmetic as without offload (fp32, bitwise), at ZeRO-1, 2 and 3."""
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_domino.optim.distributed_optimizer import DistributedOptimizer
from tests.harness import run_ranks
from tests.zero_setup import LR, backward_step, batches, new_model, optimizer_config

pytestmark = pytest.mark.slow  # multi-rank


def _train(group, dp_rank, dp, data, opt, gate=False):
    """Three steps. ``gate``: the host thread's step of the first step's last bucket (in forward order) waits
    until the second step's forward has begun, so a step that waited for its host work would time out.
    Returns the weights, and what the host step had completed when each forward began and ended."""
    model = new_model()
    dopt = DistributedOptimizer([model], opt, dp_group=group, tp_rank=0, norm_groups=[])
    host, forward_began, seen = dopt.host, threading.Event(), []
    if gate:
        assert len(host.order) >= 3, "the test needs several offloaded buckets"
        last, step_bucket = host.members[id(host.order[-1][1])], host._step_bucket

        def gated(indices, copied):
            if indices is last and not forward_began.is_set():
                assert forward_began.wait(timeout=30), "the host step was waited for before the next forward"
            step_bucket(indices, copied)

        host._step_bucket = gated
    model.embedding.word_embeddings.register_forward_pre_hook(lambda *_: seen.append(("began", host.done)))
    for step, (tokens, labels) in enumerate(data[:3]):
        if step == 1:
            model.embedding.word_embeddings.register_forward_pre_hook(lambda *_: forward_began.set())
        backward_step(model, dopt, tokens, labels, dp_rank, dp)
        seen.append(("ended", host.done))
        assert dopt.step(LR)[0]
    late = host.late
    with dopt.gathered_weights():
        return {name: p.detach().clone() for name, p in model.named_global_parameters()}, seen, late, len(host.order)


def _checks(rank, world):
    group = dist.new_group(list(range(world)))
    data = batches(3)
    for stage in (1, 2, 3):
        plain, *_ = _train(group, rank, world, data, optimizer_config(zero_stage=stage))
        for fraction, overlap in ((1.0, True), (0.5, True), (1.0, False)):
            opt = optimizer_config(zero_stage=stage, offload="cpu", offload_fraction=fraction,
                                   overlap_offload_step=overlap)
            weights, seen, late, buckets = _train(group, rank, world, data, opt, gate=overlap)
            what = f"zero {stage} offload {fraction} overlap {overlap}"
            for name, value in weights.items():
                assert torch.equal(value, plain[name]), f"{what}: {name}"
            assert late == 0, f"{what}: {late} buckets were not read by the next forward"
            # micro-batch forwards: 2 per step; the first of steps 2 and 3 begins with nothing completed
            began = [done for event, done in seen if event == "began"]
            ended = [done for event, done in seen if event == "ended"]
            if overlap:
                assert began[2] == 0 and began[4] == 0, (what, seen)
            else:
                assert set(began) == {buckets}, (what, seen)
            assert set(ended) == {buckets}, (what, seen)  # every bucket read by the end of each backward
    return True


def test_host_step_runs_behind_the_next_forward():
    """dp 2, ZeRO-1/2/3, the whole shard or half of it offloaded, overlap on and off: bitwise the run without
    offload; with overlap, the next forward begins before the host step's last bucket is done (a gate that
    would time out otherwise) and with none of them completed; every bucket is completed by a forward read."""
    assert all(run_ranks(_checks, 2, timeout=300))
