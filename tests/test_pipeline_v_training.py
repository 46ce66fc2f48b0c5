"""ZB-V and DualPipeV train like one process: 6 SGD steps (fp32, 1e-5 on every loss and weight) through the executor
under NCCL's p2p rules (the strict transport), Domino on throughout: pp 2 and pp 4 (GPT with tied embeddings, whose
two copies both sit on rank 0 in the V; Llama untied), pp 2 x dp 2 with ZeRO-1, tp 2 x pp 2 x dp 2 (8 ranks, one
with sequence parallelism) and MoE with ep 2.

What can go wrong and shows here: chunk 1's transfers sent to the wrong neighbour (strict transport: a mismatch or a
timeout), the turn's local handoff dropping the gradient back into chunk 0 (the first stages' weights), the DP
reduction cued by a chunk's last B while its split I/W's still come (DualPipeV mixes both: the gradient buffers
refuse a late gradient), the tied copies not summed on rank 0 (embedding weights).
"""
from dataclasses import replace

import pytest

from megatron_domino.pipeline.program import Overlapped
from megatron_domino.pipeline.schedules import build_schedule
from tests.harness import run_ranks
from tests.parity import assert_covered, assert_same_run, layout_config
from tests.test_context_parallel import LLAMA_16, _layout as cp_layout, _reference as cp_reference
from tests.test_context_parallel import _train as cp_train
from tests.test_expert_parallel import DROPLESS_LLAMA, _covered, _run
from tests.test_pipeline import GLOBAL_BATCH, GPT, LLAMA
from tests.test_zero_bubble import OPT, _check

pytestmark = pytest.mark.slow  # multi-rank training runs: the whole suite, not -m quick

GPT8, LLAMA8 = replace(GPT, num_layers=8), replace(LLAMA, num_layers=8)  # pp 4 x 2 chunks: one layer per stage


def _v(model, kind, micro, zero=1, **parallel):
    """(model, config) of a V schedule: ``micro`` sets the micro-batches per DP rank (zb-v needs pp, dualpipev 2 pp)."""
    cfg = layout_config(model, micro, GLOBAL_BATCH, replace(OPT, zero_stage=zero), pipeline_schedule=kind,
                        virtual_pp=2, domino=True, **parallel)
    return model, cfg


def _assert_all_covered(layouts, per_rank):
    for index, (_, cfg) in enumerate(layouts):
        assert_covered(cfg.parallel, [rank[index][0] for rank in per_rank], per_rank[0][index][1])


FOUR_RANKS = [_v(GPT8, "zb-v", 2, pp=4), _v(LLAMA8, "dualpipev", 1, pp=4),
              _v(LLAMA, "zb-v", 2, pp=2, dp=2, zero=2),
              _v(replace(GPT, recompute="full"), "dualpipev", 1, pp=2, dp=2, zero=3)]  # W and recompute gather again
CONTEXT = [cp_layout(LLAMA_16, cp=2, pp=2, virtual_pp=2, documents=True)]  # made zb-v below


def _check_with_context(rank, world_size, layouts, context_layouts):
    compared = _check(rank, world_size, layouts)
    for cfg, documents in context_layouts:
        cfg.parallel.pipeline_schedule = "zb-v"
        ref_losses, ref_weights = cp_reference(cfg.model, documents)
        losses, weights = cp_train(world_size, cfg, documents)
        compared.append((assert_same_run(("cp", cfg.parallel.cp), losses, weights, ref_losses, ref_weights),
                         list(ref_weights)))
    return compared


def test_v_schedules_train_like_one_process_at_pp4_pp2_dp2_and_cp2():
    """One spawn of 4 ranks: zb-v and dualpipev at pp 4 (1 layer per stage); at pp 2 x dp 2 with ZeRO-2, and ZeRO-3
    with full recompute; zb-v at cp 2 x pp 2 with packed documents."""
    per_rank = run_ranks(_check_with_context, 4, FOUR_RANKS, CONTEXT, timeout=480)
    layouts = FOUR_RANKS + [(cfg.model, cfg) for cfg, _ in CONTEXT]
    _assert_all_covered(layouts, per_rank)


EIGHT_RANKS = [_v(GPT, "zb-v", 1, tp=2, pp=2, dp=2, domino_split="2d"),
               # Domino's row split; ZeRO-3 gathers while the F&B units' halves take turns (parallel/turns.py)
               _v(LLAMA, "dualpipev", 1, zero=3, tp=2, pp=2, dp=2, sequence_parallel=True, overlap_f_and_b=True),
               _v(GPT, "zb-v", 1, tp=2, pp=2, dp=2, domino_split="column")]


def test_v_schedules_train_like_one_process_at_tp2_pp2_dp2_with_domino():
    """8 ranks: tp 2 x pp 2 x dp 2 under each Domino split (row with SP, ZeRO-3 and the F&B turns under dualpipev,
    2-D and column under zb-v)."""
    per_rank = run_ranks(_check, 8, EIGHT_RANKS, timeout=600)
    _assert_all_covered(EIGHT_RANKS, per_rank)


def _moe_layouts():
    model = replace(DROPLESS_LLAMA, num_layers=4)  # pp 2 x 2 chunks
    return [(layout_config(model, 1, GLOBAL_BATCH, replace(OPT, zero_stage=1), ep=2, dp=2, pp=2, virtual_pp=2,
                           pipeline_schedule=kind, domino=True), 1) for kind in ("zb-v", "dualpipev")]


def _check_moe(rank, world_size):
    return _run(world_size, _moe_layouts())


def test_v_schedules_train_moe_with_ep2_like_one_process():
    """MoE (dropless Llama, auxiliary losses on) at pp 2 x dp 2 x ep 2 under both V schedules."""
    assert any(isinstance(step, Overlapped) for step in build_schedule("dualpipev", 2, 4, 2)[0])  # F&B units run
    _covered(_moe_layouts(), run_ranks(_check_moe, 4, timeout=420))
