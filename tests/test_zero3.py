"""ZeRO-3 (``optimizer.zero_stage: 3``): weights sharded over dp x cp and gathered layer by layer, against one
process (fp32, 1e-5), alone and composed with TP + Domino (row and 2-D, SP), every pipeline schedule,
recompute, CP and EP; its window of gathered layers (a layer released after its forward, the next one's
gather in flight while one computes); fp16 loss scaling, offload; its memory; bad settings refused."""
import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from megatron_domino.config import ConfigError
from megatron_domino.config.loader import load_config
from megatron_domino.models import LanguageModel, initialize_weights
from megatron_domino.optim.distributed_optimizer import DistributedOptimizer
from megatron_domino.optim.sharded_state import sharded_weight_fragments
from megatron_domino.training.checkpoint import model_state
from megatron_domino.tensor_parallel import LayerContext
from megatron_domino.validation import validate_config
from tests.harness import run_ranks
from tests.parity import assert_covered, assert_same_run
from tests.test_context_parallel import _layout as cp_layout, _reference as cp_reference, _train as cp_train
from tests.test_expert_parallel import _config as ep_config, _run as ep_run
from tests.test_moe import GPT_MOE
from tests.test_pipeline import GPT, LLAMA, MICRO_BATCH
from tests.test_schedule_compositions import _check as check_schedules, _layout
from tests.test_zero import check_fp16_overflow, check_offload_is_the_same_arithmetic, check_parity
from tests.training_runs import REPO, TINY
from tests.zero_setup import (CFG, GLOBAL_BATCH, SEED, STEPS, batches, held_state, loss_of, optimizer_config,
                              reference, storage_bytes)

pytestmark = pytest.mark.slow  # multi-rank training runs: the whole suite, not -m quick


# ----- the window of gathered layers -------------------------------------------------------------------------
def _one_backward(dopt, model, data, dp_rank, dp):
    """One micro-batch's forward and backward; returns the units held when forward ended."""
    tokens, labels = data[0]
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    dopt.zero_grad()
    dopt.begin_backward(True)
    loss = loss_of(model, tokens[rows], labels[rows])
    after_forward = [unit.name for unit in dopt.units.held]
    loss.backward()
    dopt.finish_grad_sync()
    return after_forward


def check_gathers_follow_the_layers(group, dp_rank, dp, data):
    """Forward and backward touch the units in their orders. With prefetch depth 1, while a unit computes only
    it and the next one are held (the per-layer high-water mark: nothing stays gathered after its forward),
    and the next one's gather was launched before (a prefetch, never an on-demand gather after the first);
    depth 0 gathers each on use; reshard_after_forward false keeps every unit from forward to backward."""
    for depth, reshard in ((1, True), (0, True), (1, False)):
        model = LanguageModel(replace(CFG, num_layers=4), LayerContext())
        initialize_weights(model, SEED, 0, 1)
        opt = optimizer_config(zero_stage=3, prefetch_depth=depth, reshard_after_forward=reshard)
        dopt = DistributedOptimizer([model], opt, dp_group=group, tp_rank=0, norm_groups=[])
        units, sizes = dopt.units, {unit.name: unit.nbytes() for unit in dopt.units.units}
        units.trace = []
        after_forward = _one_backward(dopt, model, data, dp_rank, dp)
        what = f"prefetch_depth={depth} reshard_after_forward={reshard}"
        for backward in (False, True):
            order = [unit.name for unit in units.orders[(0, backward)]]
            touched = [(name, held) for name, in_backward, held in units.trace if in_backward == backward]
            assert [name for name, _ in touched] == order, (what, backward, touched, order)
            for position, (name, held) in enumerate(touched):
                following = order[position + 1] if position + 1 < len(order) else None
                window = {name, following} if depth else {name}
                if reshard or backward:
                    assert set(held) - {None} <= window, (what, backward, name, held)
                    assert sum(sizes[n] for n in held) <= sum(sizes[n] for n in window - {None}), (what, name)
                if depth and following is not None:
                    assert following in held, f"{what}: {following}'s gather was not in flight while {name} computed"
        touches = len(units.trace)
        assert units.on_demand == (1 if depth else touches - 1), (what, units.on_demand, touches)  # 1: the head's
        if reshard:
            assert len(after_forward) <= 1 + depth, (what, after_forward)
        else:
            assert set(after_forward) == set(sizes), (what, after_forward)
        dopt.step(1e-3)
        assert not units.held, f"{what}: units stay gathered after the step"


def check_memory(group, dp_rank, dp, data):
    """bf16 + Adam, fp32 gradients: model state per weight is 18/d bytes (the vectors, whole on every rank, add
    their own; so does the shards' alignment, a few percent at this tiny size), counted from the storages held (each
    once), and at most two units are ever gathered at once (prefetch depth 1)."""
    model = LanguageModel(replace(CFG, num_layers=4), LayerContext(dtype=torch.bfloat16))
    initialize_weights(model, SEED, 0, 1)
    opt = optimizer_config(zero_stage=3, bucket_size_mb=25.0)
    dopt = DistributedOptimizer([model], opt, dp_group=group, tp_rank=0, norm_groups=[], bf16=True)
    for _ in range(2):
        _one_backward(dopt, model, data, dp_rank, dp)
        assert dopt.step(1e-3)[0]
    report, held = dopt.memory_report(), held_state(dopt)  # the counters, and the storages themselves
    vectors = sum(p.numel() for p in model.parameters() if p.dim() < 2) / report["params"]
    per_weight = sum(storage_bytes(tensors) for tensors in held.values()) / report["params"]
    assert report["weight_bytes"] == storage_bytes(held["weights"]), report
    padded = sum(b.size for buffer in dopt.buffers for b in buffer.buckets) / report["params"]  # aligned shards
    assert per_weight <= 18 / dp * padded * 1.01 + 2 * vectors, (per_weight, padded, report)
    largest = sorted(unit.nbytes() for unit in dopt.units.units)[-2:]
    assert 0 < report["gathered_peak_bytes"] <= sum(largest), report
    return round(per_weight, 3)


def check_a_save_offers_the_shard_alone(group, world):
    """What a rank hands the checkpoint writer (``training.checkpoint.model_state``): its fragments of the sharded
    weights, as views of its shard (nothing gathered), and the vectors ZeRO-3 keeps whole (written once by DCP)."""
    model = LanguageModel(CFG, LayerContext(dtype=torch.bfloat16))
    initialize_weights(model, SEED, 0, 1)
    dopt = DistributedOptimizer([model], optimizer_config(zero_stage=3), dp_group=group, tp_rank=0, norm_groups=[],
                                bf16=True)
    shards, names = sharded_weight_fragments(dopt), dict(model.named_global_parameters())
    shard_storages = {buffer.weights.shard.untyped_storage().data_ptr() for buffer in dopt.buffers
                      if buffer.weights.sharded}
    offered = 0
    for key, stored in model_state([model], 0, dopt).items():
        param = names[key.removeprefix("model/")]
        for piece in stored.pieces:
            offered += math.prod(piece.sizes)
            assert id(param) not in shards or piece.tensor.untyped_storage().data_ptr() in shard_storages, key
    own = sum(f.end - f.start for fragments in shards.values() for f in fragments)
    whole = sum(p.numel() for p in model.parameters() if id(p) not in shards)
    assert offered == own + whole and own < 1.1 * sum(p.numel() for p in model.parameters()) / world, (offered, own)


def _dp_checks(rank, world):
    group = dist.new_group(list(range(world)))
    data = batches(STEPS)
    adamw = reference(data, optimizer_config())
    for overrides in ({}, {"prefetch_depth": 0}, {"reshard_after_forward": False}, {"overlap_grad_reduce": False}):
        check_parity(group, rank, world, data, adamw, optimizer_config(zero_stage=3, **overrides))
    check_gathers_follow_the_layers(group, rank, world, data)
    per_weight = check_memory(group, rank, world, data)
    check_a_save_offers_the_shard_alone(group, world)
    check_fp16_overflow(group, rank, world, data, stage=3)
    check_offload_is_the_same_arithmetic(group, rank, world, data, cases=((3, 1.0), (3, 0.5)))
    return per_weight


@pytest.mark.parametrize("dp", [2, 4])
def test_zero3_data_parallel_matches_one_process(dp):
    """AdamW at dp 2 and 4 (prefetch 1 and 0, reshard off, overlap off), the gather window, memory, what a save
    offers, a skipped fp16 step and offload (the same arithmetic as on the device)."""
    per_weight = run_ranks(_dp_checks, dp, timeout=300)
    print(f"ZeRO-3 at dp {dp}: {per_weight[0]} bytes of model state per weight (18/d = {18 / dp:.2f})")


# ----- composed with the rest (SGD through the pipeline engine, as the trainer runs it) ----------------------
def _zero3(model, tp, pp, dp, *, schedule=None, virtual_pp=1, zero_stage=3, offload_fraction=None, **parallel):
    """A layout at ZeRO-3 (or ``zero_stage``), with ``offload_fraction`` of the optimizer on the host if given."""
    model, cfg = _layout(model, tp, pp, dp, virtual_pp=virtual_pp, schedule=schedule, zero_stage=zero_stage)
    if offload_fraction is not None:
        cfg.optimizer = replace(cfg.optimizer, offload="cpu", offload_fraction=offload_fraction)
    for name, value in parallel.items():
        setattr(cfg.parallel, name, value)
    cfg.data.mock = True
    validate_config(cfg, world_size=tp * pp * dp, check_paths=False)
    return model, cfg


def _check_layouts(rank, world, layouts, cp_layouts=(), ep_layouts=()):
    compared = check_schedules(rank, world, layouts)
    for cfg, documents in cp_layouts:
        ref_losses, ref_weights = cp_reference(cfg.model, documents)
        losses, weights = cp_train(world, cfg, documents)
        compared.append((assert_same_run(("cp", cfg.parallel.cp), losses, weights, ref_losses, ref_weights),
                         list(ref_weights)))
    return compared + (ep_run(world, ep_layouts) if ep_layouts else [])


def _covered(layouts, per_rank):
    for index in range(len(layouts)):
        assert_covered(index, [rank[index][0] for rank in per_rank], per_rank[0][index][1])


FOUR = [_zero3(LLAMA, 2, 1, 2, domino=True, sequence_parallel=True),  # Domino row split, SP
        _zero3(GPT, 2, 1, 2, domino=True, domino_split="2d"),  # Domino 2-D
        _zero3(replace(GPT, recompute="full"), 2, 1, 2, domino=True),  # a recomputed phase reads its weights again
        _zero3(replace(LLAMA, recompute="selective"), 2, 1, 2, domino=True, domino_split="column"),
        _zero3(GPT, 2, 1, 2, zero_stage=1, offload_fraction=0.5, domino=True)]  # the host steps behind Domino's reads
CP = [cp_layout(GPT, cp=2, dp=2, zero_stage=3, documents=True)]  # weights sharded over dp x cp
EP = [(ep_config(replace(GPT_MOE, moe_grouped_gemm=True), ep=2, dp=4, zero=3), MICRO_BATCH),  # experts over 2
      (ep_config(GPT_MOE, ep=2, dp=2, tp=2, expert_tp=1, zero=3), MICRO_BATCH)]  # whole experts over tp x ep


def test_zero3_composes_with_tp_domino_recompute_cp_and_ep():
    """4 ranks: tp 2 × dp 2 with Domino (row split with SP; 2-D; full recompute; selective recompute with the
    column split; ZeRO-1 with half the optimizer offloaded),
    cp 2 × dp 2 with packed documents, dp 4 × ep 2 (expert weights sharded over their 2
    replicas), tp 2 × dp 2 × ep 2 with expert TP 1. 6 SGD steps each, 1e-5."""
    per_rank = run_ranks(_check_layouts, 4, FOUR, CP, EP, timeout=400)
    _covered(FOUR + CP + EP, per_rank)


EIGHT = [_zero3(LLAMA, 2, 2, 2, domino=True),  # 1F1B
         _zero3(LLAMA, 2, 2, 2, virtual_pp=2, domino=True, offload_fraction=1.0),  # interleaved, offloaded
         _zero3(GPT, 2, 2, 2, schedule="zb-h1", domino=True),  # W gathers the weights again
         _zero3(replace(GPT, recompute="full"), 2, 2, 2, schedule="zb-h1", domino=True, sequence_parallel=True)]


def test_zero3_under_every_pipeline_schedule():
    """8 ranks, tp 2 × pp 2 × dp 2 with Domino: 1F1B, interleaved (the optimizer offloaded),
    ZB-H1, and ZB-H1 with full recompute and SP
    (the tied embedding's shards summed across the first and last stage)."""
    _covered(EIGHT, run_ranks(_check_layouts, 8, EIGHT, timeout=500))


# ----- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.quick
@pytest.mark.parametrize("overrides, key, rule", [
    (["optimizer.prefetch_depth=-1"], "optimizer.prefetch_depth", "must be an integer in [0, 4]"),
    (["optimizer.prefetch_depth=7"], "optimizer.prefetch_depth", "must be an integer in [0, 4]"),
    (["optimizer.zero_stage=5"], "optimizer.zero_stage", "must be one of"),
])
def test_bad_zero3_settings_are_refused_before_any_group(no_process_group, overrides, key, rule):
    cfg = load_config(f"{REPO}/{TINY['gpt']}", ["data.mock=true", "optimizer.zero_stage=3", *overrides])
    with pytest.raises(ConfigError) as error:
        validate_config(cfg, world_size=8, check_paths=False)
    assert key in str(error.value) and rule in str(error.value), str(error.value)
