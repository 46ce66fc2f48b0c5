"""Pipeline schedules composed with the rest, against one process (6 SGD steps, fp32, 1e-5): interleaved with
TP + Domino and at pp 4 × v 2, ZB-H1 and interleaved with ZeRO-2 (gradients reduce-scattered per bucket), and
Domino's row split into 4 μ-chunks under a pipeline. Every layout under NCCL's p2p rules (the strict state)."""
from dataclasses import replace

import pytest

from tests.harness import run_ranks
from tests.parity import assert_covered, assert_same_run
from tests.test_pipeline import GPT, LLAMA, _config
from tests.test_zero_bubble import OPT, _reference, _train

pytestmark = pytest.mark.slow  # multi-rank training runs: the whole suite, not -m quick

GPT_8 = replace(GPT, num_layers=8)  # one layer per virtual stage at pp 4 × v 2


def _layout(model, tp, pp, dp, *, virtual_pp=1, schedule=None, zero_stage=1, domino_chunks=2, micro_batch=2):
    cfg = _config(model, tp, pp, dp, virtual_pp=virtual_pp)
    cfg.parallel.pipeline_schedule, cfg.parallel.domino_chunks = schedule, domino_chunks
    cfg.train.micro_batch_size = micro_batch
    cfg.optimizer = replace(OPT, zero_stage=zero_stage)
    return model, cfg


LAYOUTS = [
    _layout(LLAMA, 2, 2, 1, virtual_pp=2),  # interleaved, TP 2 with Domino
    _layout(GPT_8, 1, 4, 1, virtual_pp=2),  # interleaved beyond pp 2 × v 2
    _layout(GPT, 1, 2, 2, schedule="zb-h1", zero_stage=2),
    _layout(LLAMA, 1, 2, 2, virtual_pp=2, zero_stage=2),
    _layout(GPT, 2, 2, 1, domino_chunks=4, micro_batch=4),  # 4 μ-chunks of one sample each
]


def _check(rank, world_size, layouts):
    compared = []
    for model, cfg in layouts:
        ref_losses, ref_weights = _reference(model)
        losses, weights = _train(world_size, cfg)
        where = (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.virtual_pp, cfg.parallel.dp,
                 cfg.parallel.pipeline_schedule, cfg.optimizer.zero_stage, cfg.parallel.domino_chunks)
        compared.append((assert_same_run(where, losses, weights, ref_losses, ref_weights), list(ref_weights)))
    return compared


def test_schedules_compose_with_tp_domino_zero2_and_more_chunks():
    per_rank = run_ranks(_check, 4, LAYOUTS, timeout=400)
    for index, (_, cfg) in enumerate(LAYOUTS):
        assert_covered(cfg.parallel, [rank[index][0] for rank in per_rank], per_rank[0][index][1])
