"""The planner's search: every layout it suggests passes the validator, and it misses none that does.

The search filters its variants with the rule functions that ``validate_config`` gathers; the exhaustive
comparison below fails if one of its filters drifts from the validator (refusing a valid layout, or keeping
an invalid one).
"""
from __future__ import annotations

import os
from dataclasses import replace
from itertools import product

import pytest

from megatron_domino.config import load_config
from megatron_domino.config.checks import Checks
from megatron_domino.config.errors import ConfigError
from megatron_domino.config.schema import ZERO_STAGES
from megatron_domino.pipeline.schedules import build_schedule, check_schedule, names, v_shape
from megatron_domino.pipeline.simulate import simulate
from megatron_domino.planner.hardware import get_gpu
from megatron_domino.planner.search import MICRO_BATCHES, Layout, candidate_layouts, divisors, evaluate, rank_layouts
from megatron_domino.validation import validate_config
from tests.tools import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT, MIXTRAL = os.path.join(ROOT, "configs/tiny/gpt.yaml"), os.path.join(ROOT, "configs/tiny/mixtral.yaml")
CPU = get_gpu("cpu")
PIPELINE_SCHEDULES = names()


def _tiny(path, *overrides):
    return load_config(path, list(overrides))


def _schedule_passes(pp: int, v: int, kind: str | None) -> bool:
    c = Checks()
    check_schedule(c, pp, v, None, kind)
    return not c.problems


def _validator_accepts(cfg, layout: Layout) -> bool:
    try:
        validate_config(layout.apply(cfg), world_size=layout.world_size, check_paths=False)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("path, world, overrides", [
    # 2 experts shared out whole over tp x ep ranks: tp 2 x ep 2 and ep 4 are refused
    (MIXTRAL, 4, ["parallel.domino=true", "train.global_batch_size=8", "parallel.expert_tp=1", "model.num_experts=2"]),
    # 12 tokens: the ring's 2 * cp chunks fit cp 2, sequence parallelism's tp * cp does not at tp 4
    pytest.param(GPT, 8, ["parallel.domino=true", "train.global_batch_size=24", "model.seq_length=12"],
                 marks=pytest.mark.slow),  # 20 s: every layout of 8 ranks through the validator
])
def test_the_search_keeps_exactly_the_layouts_the_validator_accepts(path, world, overrides):
    """Every (tp, cp, pp, dp, v, schedule, micro batch, TP mode, ZeRO, ep, CP comm) of ``world`` ranks: the
    search's candidates are the ones validate_config accepts (the CP comm only where cp > 1: at cp 1 it is moot;
    the schedule named at pp > 1, left to the config at pp 1)."""
    cfg = _tiny(path, *overrides)
    found = set(candidate_layouts(cfg, world, only={"recompute": ["none"], "schedule": PIPELINE_SCHEDULES}))
    expected = set()
    for tp, cp, pp in product(divisors(world), repeat=3):
        if world % (tp * cp * pp):
            continue
        dp = world // (tp * cp * pp)
        domino = cfg.parallel.domino
        modes = {(False, domino)} | ({(True, False), (True, domino)} if tp > 1 else set())
        comms = [("ring", None)] + ([("a2a", None)] + [("a2a+ring", n) for n in divisors(cp)[1:-1]] if cp > 1 else [])
        schedules = PIPELINE_SCHEDULES if pp > 1 else (None,)
        for v, kind, b, (sp, domino), zero, ep, comm in product(range(1, 5), schedules, MICRO_BATCHES, modes,
                                                                ZERO_STAGES, divisors(dp), comms):
            if dp * cp == 1 and zero != cfg.optimizer.zero_stage:
                continue  # one replica: the ZeRO stage is moot
            if not _schedule_passes(pp, v, kind):
                continue  # the validator refuses it whatever the batch (it runs this rule): skipped for time
            layout = Layout(tp, pp, dp, v, b, "none", zero, sp, domino, cp, ep, False, 1, *comm, kind)
            if _validator_accepts(cfg, layout):
                expected.add(layout)
    assert found == expected, (sorted(found - expected, key=str)[:3], sorted(expected - found, key=str)[:3])


# ----- the search and the published layouts ----------------------------------------------------------
def test_every_ranked_layout_is_valid_and_ranking_puts_fitting_fast_ones_first():
    cfg = _tiny(GPT)
    ranked = rank_layouts(cfg, CPU, nodes=1, gpus_per_node=8)
    assert {(e.layout.tp, e.layout.pp) for e in ranked} >= {(1, 1), (2, 2), (4, 2), (2, 4)}
    assert {e.layout.cp for e in ranked} == {1, 2, 4, 8}
    for est in ranked:  # the search validates one layout per (tp, cp, pp); recompute is not among the rules
        if est.layout.recompute == "none":
            validate_config(est.layout.apply(cfg), world_size=8, check_paths=False)
    for est in ranked[:3]:  # what --emit prints goes through the loader too
        assert load_config(GPT, est.layout.overrides()) == est.layout.apply(cfg)
    fitting = [e for e in ranked if e.fits]
    assert ranked[:len(fitting)] == fitting
    times = [float(f"{e.time.total:.3g}") for e in fitting]
    assert times == sorted(times)


def test_an_invalid_layout_is_never_suggested():
    cfg = _tiny(GPT)  # 4 heads: tp 8 cannot divide them; 4 layers: pp 8 cannot hold them
    layouts = {(e.layout.tp, e.layout.pp) for e in rank_layouts(cfg, CPU, nodes=2, gpus_per_node=8)}
    assert all(tp <= 4 and pp <= 4 for tp, pp in layouts)


def _fits(cfg, gpu, world, **only):
    ranked = rank_layouts(cfg, gpu, nodes=world // 8, gpus_per_node=8, only={k: [v] for k, v in only.items()})
    assert ranked, f"no valid layout with {only}"
    return any(e.fits for e in ranked)


@pytest.mark.slow  # published GPT-3 175B and Llama-2 70B layouts planned and ranked: out of the quick tier
def test_published_layouts_are_feasible_and_impossible_ones_are_not():
    h100 = get_gpu("h100-80gb")
    gpt175 = load_config(os.path.join(ROOT, "configs/gpt/175b.yaml"))
    llama70 = load_config(os.path.join(ROOT, "configs/llama/llama2-70b.yaml"))
    # Megatron-LM's GPT-3 175B recipe (examples/gpt3/train_gpt3_175b_distributed.sh): TP 8, PP 16, micro batch 1
    assert evaluate(gpt175, Layout(8, 16, 1, 1, 1, "none", 1, False, True), h100, 8).fits
    assert _fits(llama70, h100, 64, tp=8, pp=2)
    assert _fits(llama70, h100, 64, tp=4, pp=4)  # NeMo's Llama-2 70B recipe (launcher conf llama2_70b.yaml)
    for stage in (0, 1, 2):
        assert not _fits(llama70, h100, 64, tp=1, pp=1, zero_stage=stage)  # 140 GB of bf16 weights alone
        assert not _fits(gpt175, h100, 128, tp=4, pp=1, zero_stage=stage)  # 88 GB of bf16 weights alone
    # ZeRO-3 shards the weights too: 70B over 64 GPUs is 2.2 GB of weights, 20 GB of model state in all
    assert _fits(llama70, h100, 64, tp=1, pp=1, zero_stage=3)
    # tp 8 at dp 16: 44 GB of weights + 22 GB of ZeRO-2 state (2 + 16/16 bytes per weight) + recomputed activations
    tight = rank_layouts(gpt175, h100, nodes=16, gpus_per_node=8, only={"tp": [8], "pp": [1], "zero_stage": [0, 1, 2]})
    assert {(e.layout.zero_stage, e.layout.recompute) for e in tight if e.fits and not e.layout.offload} == {
        (2, "full")}
    # the optimizer offloaded (ZeRO-2's 12/16 bytes per weight to the host) buys back the activations of recompute
    offloaded = {(e.layout.zero_stage, e.layout.recompute) for e in tight if e.fits and e.layout.offload}
    assert offloaded == {(2, "full"), (2, "selective"), (2, "none")}, offloaded


def test_plan_cli_prints_a_table_and_emits_a_loadable_layout(capsys):
    plan = load_tool("plan")
    assert plan.main(["--model", "tiny-gpt", "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4", "--top", "3"]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line[:4].strip().isdigit() and " | " in line]
    assert "valid layouts" in table and len(rows) == 3
    assert plan.main(["--model", "tiny-gpt", "--gpu", "cpu", "--gpus-per-node", "4", "--tp", "2", "--emit"]) == 0
    overrides = capsys.readouterr().out.split()
    assert "parallel.tp=2" in overrides
    validate_config(load_config(GPT, overrides), world_size=4, check_paths=False)
    assert plan.main(["--model", "no-such-model"]) == 2


def test_memory_savers_are_tried_only_where_a_layout_does_not_fit():
    """Offload (ZeRO >= 1) and no prefetch (ZeRO-3) appear only on layouts whose plain form does not fit; each
    saver row costs no less time and no more memory than that form, and is emitted as loadable overrides."""
    llama70 = load_config(os.path.join(ROOT, "configs/llama/llama2-70b.yaml"))
    h100 = get_gpu("h100-80gb")
    ranked = rank_layouts(llama70, h100, nodes=4, gpus_per_node=8, only={"tp": [8], "pp": [1, 2]})
    plain = {e.layout: e for e in ranked if not e.layout.offload and e.layout.prefetch_depth == 1}
    savers = [e for e in ranked if e.layout.offload or e.layout.prefetch_depth == 0]
    assert savers and any(e.fits for e in savers)
    for est in savers:
        base = plain[replace(est.layout, offload=False, prefetch_depth=1)]
        assert not base.fits, est.layout
        assert est.memory.total <= base.memory.total and est.time.total >= base.time.total, est.layout
        assert est.layout.zero_stage > 0 and (est.layout.prefetch_depth == 1 or est.layout.zero_stage == 3)
    best = next(e for e in savers if e.fits)
    assert load_config(os.path.join(ROOT, "configs/llama/llama2-70b.yaml"), best.layout.overrides()) == \
        best.layout.apply(llama70)


# ----- the pipeline schedule -----------------------------------------------------------------------------
GPT13 = os.path.join(ROOT, "configs/gpt/1.3b.yaml")
PP4 = {"tp": [1], "cp": [1], "pp": [4], "schedule": PIPELINE_SCHEDULES}  # 8 GPUs: dp 2, every schedule asked for


def _simulated_bubble(kind, pp, m, v):
    return simulate(build_schedule(kind, pp, m, v), m, v, v_shape=v_shape(kind)).bubble_fraction


def test_the_search_picks_zb_v_where_it_fits_and_has_the_micro_batches():
    """GPT 1.3B on 8 H100s at pp 4, 16 sequences a step: at micro batch 1 (m 8 per DP rank) every schedule runs and
    the simulator puts ZB-V's bubble lowest: the search ranks it first. Micro batch 2 (m 4 < 2 pp) leaves DualPipeV
    out, micro batch 4 (m 2 < pp, and not a multiple of pp) ZB-V and interleaving too."""
    cfg = load_config(GPT13, ["train.global_batch_size=16"])
    ranked = rank_layouts(cfg, get_gpu("h100-80gb"), nodes=1, gpus_per_node=8, only=PP4)
    best = next(e for e in ranked if e.fits)
    assert best.layout.schedule == "zb-v" and "parallel.pipeline_schedule=zb-v" in best.layout.overrides()
    m = 16 // (best.layout.micro_batch * 2)
    assert m >= 4
    bubbles = {kind: _simulated_bubble(kind, 4, m, v) for kind, v in
               [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zb-v", 2)] + [("dualpipev", 2)] * (m >= 8)}
    assert min(bubbles, key=bubbles.get) == "zb-v"
    same = {e.layout.schedule: e for e in ranked if replace(e.layout, schedule=None, virtual_pp=1) ==
            replace(best.layout, schedule=None, virtual_pp=1)}
    assert same.keys() >= {"1f1b", "zb-h1", "zb-v"} and same["1f1b"].time.total > best.time.total
    assert load_config(GPT13, ["train.global_batch_size=16", *best.layout.overrides()]) == best.layout.apply(cfg)
    schedules = lambda mbs: {e.layout.schedule for e in ranked if e.layout.micro_batch == mbs}  # noqa: E731
    assert schedules(1) == set(PIPELINE_SCHEDULES)
    assert schedules(2) == set(PIPELINE_SCHEDULES) - {"dualpipev"}
    assert schedules(4) == {"1f1b", "zb-h1"}


def test_unasked_the_search_keeps_to_the_schedules_whose_memory_it_models():
    """Without --schedule the split-backward schedules stay out (their I-to-W gradients are not yet counted)."""
    cfg = load_config(GPT13, ["train.global_batch_size=16"])
    ranked = rank_layouts(cfg, get_gpu("h100-80gb"), nodes=1, gpus_per_node=8, only={"tp": [1], "cp": [1], "pp": [4]})
    assert {e.layout.schedule_mode for e in ranked} == {"1f1b", "interleaved"}


def test_a_schedule_the_config_fixes_is_kept():
    """parallel.pipeline_schedule: 1f1b in the config: every layout runs 1F1B (one chunk per rank), and the
    overrides say so."""
    cfg = load_config(GPT13, ["train.global_batch_size=16", "parallel.pipeline_schedule=1f1b"])
    ranked = rank_layouts(cfg, get_gpu("h100-80gb"), nodes=1, gpus_per_node=8, only={"tp": [1], "cp": [1]})
    assert {e.layout.schedule for e in ranked} == {"1f1b"} and {e.layout.virtual_pp for e in ranked} == {1}
    assert {e.layout.pp for e in ranked} == {1, 2, 4, 8}
    best = next(e for e in ranked if e.fits and e.layout.pp == 4)
    assert "parallel.pipeline_schedule=1f1b" in best.layout.overrides()
    assert load_config(GPT13, best.layout.overrides()).parallel.pipeline_schedule == "1f1b"
