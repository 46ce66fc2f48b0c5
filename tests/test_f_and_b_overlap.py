"""DualPipeV's F&B units with their halves taking turns (``parallel.overlap_f_and_b``, ``parallel/turns.py``):
the same numbers as the halves run in sequence, bit for bit, and as one process within 1e-5 over 6 SGD steps;
the turns were taken; and every group's members issued their collectives in the same order (NCCL's rule, which
gloo would not enforce: two all-reduces of one shape swapped on one rank sum the wrong tensors silently).

tp 2 x pp 2 (4 ranks) with Domino: Llama with the row split and SP, GPT with the column split and full
recompute (the backward's recompute runs while the forward's thread waits for its turn), and a dropless MoE
(auxiliary losses on; its reference routes per micro-batch, ``tests.test_moe._reference``); and the MoE at
pp 2 x dp 2 x ep 2 without TP, whose turns fall at the experts' exchanges. ZeRO-3 with the turns runs in
``test_pipeline_v_training`` (tp 2 x pp 2 x dp 2).
"""
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from megatron_domino.pipeline.program import Overlapped
from tests.harness import run_ranks
from tests.parity import assert_covered, assert_same_run, layout_config, train_steps
from tests.test_expert_parallel import DROPLESS_LLAMA, _microbatches
from tests.test_moe import _reference as moe_reference
from tests.test_pipeline import GLOBAL_BATCH, GPT, LLAMA
from tests.test_zero_bubble import LR, OPT, _batches, _reference, _train

pytestmark = pytest.mark.slow  # multi-rank training runs: the whole suite, not -m quick


def _layout(model, micro, tp=2, **parallel):
    return layout_config(model, micro, GLOBAL_BATCH, OPT, tp=tp, pp=2, virtual_pp=2, domino=True,
                         pipeline_schedule="dualpipev", overlap_f_and_b=True, **parallel)


MOE = replace(DROPLESS_LLAMA, num_layers=4)
LAYOUTS = [_layout(LLAMA, 2, sequence_parallel=True), _layout(replace(GPT, recompute="full"), 1, domino_split="column"),
           _layout(MOE, 2),
           # no TP: the turns fall at the experts' exchanges alone (dispatch and combine, forward and backward)
           _layout(MOE, 1, tp=1, dp=2, ep=2)]
_RECORDED = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "broadcast",
             "all_gather_single", "reduce_scatter_single")  # the flat collectives' names from torch 2.13


def _record_collectives(calls: list) -> dict:
    """Wrap torch.distributed's collectives so that each call appends (group's ranks, name, shape); returns the
    originals to put back."""
    originals = {name: getattr(dist, name) for name in _RECORDED if hasattr(dist, name)}

    def recording(name, original):
        def call(tensor, *args, group=None, **kwargs):
            ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
            varies = name == "all_to_all_single"  # the experts' exchange: each member's rows differ
            calls.append((ranks, name, None if varies else tuple(tensor.shape)))
            return original(tensor, *args, group=group, **kwargs)
        return call
    for name, original in originals.items():
        setattr(dist, name, recording(name, original))
    return originals


def _train_layout(world_size, cfg, check_engine):
    """6 SGD steps of ``cfg``: (losses, weights)."""
    if cfg.model.num_experts:
        micro = _microbatches(cfg.model, cfg.train.micro_batch_size)
        return train_steps(world_size, cfg, OPT, micro, LR, check_engine)
    return _train(world_size, cfg, check_engine)


def _one_process(cfg):
    """The same 6 steps on one process (an MoE routes per micro-batch, as the engine does): (losses, weights)."""
    if cfg.model.num_experts:
        return moe_reference(cfg.model, cfg.train.micro_batch_size, _batches(cfg.model), [])
    return _reference(cfg.model)


def _check(rank, world_size):
    results = []
    for cfg in LAYOUTS:
        handovers, calls = [], []

        def count_handovers(engine):
            assert engine.executor.overlap_units is not None
            assert any(isinstance(step, Overlapped) for step in engine.program)
            handovers.append(engine.executor)
        originals = _record_collectives(calls)
        try:
            losses, weights = _train_layout(world_size, cfg, count_handovers)
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)
        in_turns = handovers[0].handovers
        sequential = replace(cfg, parallel=replace(cfg.parallel, overlap_f_and_b=False))
        seq_losses, seq_weights = _train_layout(world_size, sequential, lambda e: handovers.append(e.executor))
        assert handovers[1].overlap_units is None and handovers[1].handovers == 0
        assert losses == seq_losses, (losses, seq_losses)  # bit for bit
        assert all(torch.equal(weights[name], seq_weights[name]) for name in weights)
        ref_losses, ref_weights = _one_process(cfg)
        where = {key: getattr(cfg.parallel, key) for key in ("tp", "pp", "dp", "ep")}
        compared = assert_same_run(where, losses, weights, ref_losses, ref_weights)
        results.append((compared, list(ref_weights), in_turns, calls))
    return results


def test_f_and_b_turns_equal_the_halves_in_sequence_and_one_process():
    per_rank = run_ranks(_check, 4, timeout=480)
    for index, cfg in enumerate(LAYOUTS):
        assert_covered(cfg.parallel, [rank[index][0] for rank in per_rank], per_rank[0][index][1])
        assert all(rank[index][2] > 0 for rank in per_rank), [rank[index][2] for rank in per_rank]  # turns taken
        calls = [rank[index][3] for rank in per_rank]
        groups = {ranks for rank_calls in calls for ranks, _, _ in rank_calls}
        for group in groups:  # every member of every group: the same collectives in the same order
            orders = [[(name, shape) for ranks, name, shape in calls[member] if ranks == group] for member in group]
            assert all(order == orders[0] for order in orders), (cfg.parallel.domino_split, group)
        if cfg.parallel.tp > 1:
            assert any(len(group) == 2 and group[1] - group[0] == 1 for group in groups)  # the TP groups were seen
        else:
            assert any(name == "all_to_all_single" for rank_calls in calls for _, name, _ in rank_calls)
