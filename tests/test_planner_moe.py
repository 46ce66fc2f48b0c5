"""The planner with mixture-of-experts models: the parameters a rank holds under expert parallelism, the token
all-to-alls, the search over ep, the Mixtral configs, and the ``--ep`` option's errors."""
from __future__ import annotations

import os
import re

import pytest

from megatron_domino.config import load_config
from megatron_domino.validation import validate_config
from megatron_domino.models import LanguageModel
from megatron_domino.pipeline.program import virtual_stage
from megatron_domino.pipeline.stages import layer_partition
from megatron_domino.planner.hardware import get_gpu
from megatron_domino.planner.activations import chunk_activation_bytes
from megatron_domino.planner.memory import estimate_stages, rank_parameters
from megatron_domino.planner.report import format_table
from megatron_domino.planner.search import candidate_layouts, first_valid, rank_layouts
from megatron_domino.planner.timing import estimate_step_time
from megatron_domino.tensor_parallel import LayerContext
from tests.test_planner import _batch, _build, _saved_bytes, fake_tp  # noqa: F401  (the fixture)
from tests.test_planner_cp import _filled
from tests.tools import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIXTRAL = {name: os.path.join(ROOT, "configs/mixtral", f"{name}.yaml") for name in ("8x7b", "8x22b")}
TINY = os.path.join(ROOT, "configs/tiny/mixtral.yaml")
H100 = get_gpu("h100-80gb")


def _mixtral(*overrides):
    """8x7b at tp 4 x pp 4 x dp 4 = 64 GPUs, ep 1, micro batch 2, selective recompute, ZeRO-1 (not the file's
    layout)."""
    layout = ["parallel.tp=4", "parallel.cp=1", "parallel.pp=4", "parallel.virtual_pp=1", "parallel.dp=4",
              "parallel.ep=1", "parallel.sequence_parallel=false", "parallel.domino_split=row",
              "train.micro_batch_size=2", "model.recompute=selective", "optimizer.zero_stage=1"]
    return load_config(MIXTRAL["8x7b"], [*layout, *overrides])


def _first_stage_parameters(cfg):
    """(dense, expert) parameters of one TP rank of 8x7b's first pipeline stage at tp 4 x pp 4, ep 1, by hand."""
    h, f, experts, layers, tp = 4096, 14336, 8, 8, 4  # 8 of the 32 layers on the first of 4 pipeline stages
    attention = (h * 32 * 128 + 2 * h * 8 * 128 + 32 * 128 * h) / tp  # q, k, v (8 KV groups), output
    dense = cfg.model.padded_vocab_size(tp) // tp * h + layers * (attention + 2 * h + experts * h)  # norms, router
    return dense, layers * experts * 3 * h * f / tp  # SwiGLU experts, TP-split


# ----- memory ------------------------------------------------------------------------------------
def test_expert_parameters_spread_over_ep_and_dense_ones_do_not():
    dense, expert = _first_stage_parameters(_mixtral())
    dp = 4
    for ep in (1, 4):
        first = estimate_stages(_mixtral(f"parallel.ep={ep}"), dp, H100)[0]
        assert first.params == 2 * (dense + expert / ep)  # bf16 weights
        # ZeRO-1 shards dense Adam state (fp32 master + 2 moments) over dp 4 and expert state over dp / ep
        assert first.optimizer == pytest.approx(12 * dense / dp + 12 * (expert / ep) / (dp // ep))
        # fp32 gradients, whole under ZeRO-1 (the reduce-scatter leaves the shard inside the buffer)
        assert first.grads == pytest.approx(4 * (dense + expert / ep))
    one, four = (estimate_stages(_mixtral(f"parallel.ep={ep}"), dp, H100)[0] for ep in (1, 4))
    assert one.params - four.params == 2 * expert * (1 - 1 / 4)
    # activations: only the all-to-alls' int64 regrouping orders, there and back, per routed row (k = 2 per token)
    extra = one.in_flight * 2 * 4096 * 8 * 2 * 16  # micro-batches in flight x tokens x layers x rows x bytes
    assert four.activations - one.activations == pytest.approx(extra)


def test_whole_experts_by_hand():
    """Expert TP 1 at tp 4 x ep 2 (dp 4): whole experts shared out over 8 ranks, each TP rank routing a quarter of
    the tokens through whole-width experts, over an exchange of 8 ranks."""
    dense, expert = _first_stage_parameters(_mixtral())
    whole = _mixtral("parallel.ep=2", "parallel.expert_tp=1")
    first = estimate_stages(whole, 4, H100)[0]
    assert first.params == 2 * (dense + expert / 2)  # expert / tp above, so: whole experts / (tp * ep)
    split = estimate_stages(_mixtral("parallel.ep=2"), 4, H100)[0]
    # per routed row kept by selective recompute: dispatched, combined, weighted rows, gate, indices (and the
    # exchange's two orders), fc1 + SwiGLU; rows k/tp of width f instead of k of width f/tp, per token
    h, k, tp, layers = 4096, 2, 4, 8
    row_fixed = 3 * 2 * h + 2 + 16 + 16
    per_token = (k / tp - k) * row_fixed  # the fc1 + SwiGLU bytes (4 * 2 * f * rows / width) are the same
    tokens = 2 * 4096
    assert first.activations - split.activations == pytest.approx(split.in_flight * tokens * layers * per_token)
    moved = tokens / tp * k * h * 2 * 7 / 8  # a rank's quarter of the tokens, bf16, 7 of 8 sharers elsewhere
    time = estimate_step_time(whole, 4, H100, 8).ep_exposed  # tp 4 x ep 2 in one 8-GPU node: NVLink
    assert time == pytest.approx(256 // 2 // 4 * layers * 4 * moved / 450e9, rel=1e-9)


def _moe_minus_dense(cfg):
    """Bytes per token an MoE block saves beyond a dense one (attention, norms and masks are the same)."""
    return (chunk_activation_bytes(cfg, H100, 1, False, False, moe_layers=1)
            - chunk_activation_bytes(cfg, H100, 1, False, False))


def test_moe_activations_by_hand():
    """Tiny Mixtral (h 64, 4 experts of width 64, top-2, dense FFN 128) in bf16 at tp 2 with SP, ep 2:
    128 tokens per micro-batch, 2 routed rows each."""
    cfg = load_config(TINY, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2", "parallel.ep=2",
                             "train.bf16=true", "model.recompute=selective"])
    h, f, dense_f, experts, k, t, tokens = 64, 64, 128, 4, 2, 2, 2 * 64
    router = 4 * h / t + 4 * experts + 4 * experts + 8 * k + 4 * k + 4 + 4  # fp32 input slice, logits, probs,
    # top-k indices and values, logsumexp, top-k sum
    row = 2 * h + 4 * 2 * f / t + 2 * h + 2 * h + 2 + 8 + 8 + 8 + 8  # dispatched, fc1 + SwiGLU, combined, weighted,
    # gate, assignment, token, ep order there and back
    router_weight = 4 * experts * h / tokens  # its fp32 copy, once per micro-batch
    dense = 2 * h + 4 * 2 * dense_f / t  # fc1 input, fc1 + SwiGLU
    assert _moe_minus_dense(cfg) == pytest.approx(router + k * row + router_weight - dense)
    # full recompute keeps what the projection reads: fc2's input, combined and weighted rows, gate, indices, home
    full = load_config(TINY, ["parallel.tp=2", "parallel.dp=2", "parallel.ep=2", "model.recompute=full"])  # fp32
    assert _moe_minus_dense(full) == pytest.approx(k * (4 * f / t + 4 * h + 4 * h + 4 + 8 + 8 + 8) - 4 * dense_f / t)


@pytest.mark.parametrize("tp,overrides", [
    (1, ()), (1, ("train.bf16=true", "model.recompute=full")), (1, ("model.moe_router=sigmoid",)),
    (1, ("model.moe_shared_experts=1", "model.bias=true", "model.moe_grouped_gemm=true")),
    (1, ("model.moe_layer_freq=2", "model.activation=gelu")),
    (2, ("parallel.domino=false", "parallel.sequence_parallel=true", "train.bf16=true")),
])
def test_moe_activation_estimate_matches_saved_tensors(fake_tp, tp, overrides):  # noqa: F811
    cfg = load_config(TINY, [f"parallel.tp={tp}", *overrides])
    model = _build(cfg, fake_tp(tp) if tp > 1 else None)
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length
    moe_layers = sum(map(cfg.model.is_moe_layer, range(cfg.model.num_layers)))
    estimate = chunk_activation_bytes(cfg, get_gpu("cpu"), cfg.model.num_layers, True, True, moe_layers) * tokens
    assert estimate == pytest.approx(_saved_bytes(model, _batch(cfg)), rel=0.02)


@pytest.mark.parametrize("tp,pp,overrides", [
    (2, 2, ()), (2, 1, ("model.bias=true", "model.moe_shared_experts=1", "model.moe_layer_freq=2")),
])
def test_rank_parameters_match_built_moe_stages(fake_tp, tp, pp, overrides):  # noqa: F811
    """The router and each expert's fc2 bias are replicated over TP, the rest split (as models/moe.py builds it)."""
    cfg = load_config(TINY, [f"parallel.tp={tp}", f"parallel.pp={pp}", *overrides])
    partition = layer_partition(cfg)
    for rank, estimate in enumerate(rank_parameters(cfg)):
        stage = virtual_stage(rank, 0, pp)
        model = LanguageModel(cfg.model, LayerContext(fake_tp(tp)), layer_ids=partition[stage],
                              has_embedding=stage == 0, has_head=stage == pp - 1)
        assert estimate == sum(p.numel() for p in model.parameters())


# ----- step time ---------------------------------------------------------------------------------
def _time(*overrides, gpus_per_node=8):
    return estimate_step_time(_mixtral(*overrides), 4, H100, gpus_per_node)


def test_all_to_all_is_free_at_ep_1_and_slower_across_nodes():
    tokens, m, moe_layers = 4096, 256 // 4, 8  # selective recompute: 2 all-to-alls forward, 2 backward
    assert _time("parallel.ep=1").ep_exposed == 0
    for ep, gpus_per_node, bandwidth in ((2, 8, 450e9), (4, 16, 450e9), (4, 8, 50e9)):  # tp 4 x ep 4 > 8: IB
        moved = tokens * 2 * 4096 * 2 * (ep - 1) / ep  # top-2 copies of bf16 hidden vectors leaving the rank
        time = _time(f"parallel.ep={ep}", gpus_per_node=gpus_per_node)
        assert time.ep_exposed == pytest.approx(m * moe_layers * 4 * moved / bandwidth, rel=1e-9)
    full = _time("model.recompute=full", "parallel.ep=4")  # the dispatch again (the combine is not recomputed)
    assert full.ep_exposed == pytest.approx(5 / 4 * _time("parallel.ep=4").ep_exposed)


def test_expert_gradients_reduce_over_their_replicas_only():
    dense, expert = _first_stage_parameters(_mixtral())
    dense += 4096  # the last stage holds the most: the same embedding (untied head) and the final norm
    dense_time = 2 * 3 / 4 * 4 * dense / 50e9  # fp32 all-reduce over dp 4 (ranks 0, 4, 8, 12: two nodes)
    for ep, replicas in ((1, 4), (2, 2), (4, 1)):  # every ep-th dp rank holds the same experts
        experts = 2 * (replicas - 1) / replicas * 4 * expert / ep / 50e9
        time = _time("optimizer.zero_stage=0", "optimizer.overlap_grad_reduce=false", f"parallel.ep={ep}")
        assert time.dp_exposed == pytest.approx(dense_time + experts)


def test_compute_counts_active_experts_only():
    assert _time("parallel.ep=4").compute == _time("parallel.ep=1").compute
    # half the layers dense: one 14336-wide MLP per token instead of two experts of that width
    assert _time("model.moe_layer_freq=2").compute < _time().compute


# ----- the search --------------------------------------------------------------------------------
def test_search_tries_every_ep_that_divides_dp_and_the_experts():
    layouts = candidate_layouts(load_config(TINY), 8)
    assert {lay.ep for lay in layouts} == {1, 2, 4}  # 4 experts
    assert all(lay.dp % lay.ep == 0 for lay in layouts)
    assert {lay.ep for lay in candidate_layouts(load_config(os.path.join(ROOT, "configs/tiny/llama.yaml")), 8)} == {1}
    ranked = rank_layouts(load_config(TINY), get_gpu("cpu"), 1, 8, only={"ep": [2], "tp": [1], "cp": [1]})
    assert ranked and {e.layout.ep for e in ranked} == {2}
    table = format_table(ranked, ranked[:1], moe=True)
    assert "  dp   ep   v" in table and "ep-a2a" in table and "parallel.ep=2" in ranked[0].layout.overrides()
    assert "ep-a2a" not in format_table(ranked, ranked[:1])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["8x7b", pytest.param("8x22b", marks=pytest.mark.sweep)])  # 8x22b: 40 s of search
def test_mixtral_configs_hold_the_planners_first_choice(name):
    path = MIXTRAL[name]
    world = int(re.search(r"The parallel section is the one for (\d+) GPUs", open(path).read()).group(1))
    cfg = load_config(path)
    assert validate_config(cfg, world_size=world, check_paths=False) == []
    best = first_valid(cfg, (e for e in rank_layouts(cfg, H100, world // 8, 8) if e.fits), 1)
    assert best and best[0].layout.apply(cfg) == _filled(cfg, world), \
        f"{name} on {world} GPUs: the planner recommends {' '.join(best[0].layout.overrides())}"


# ----- bad input ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan():
    return load_tool("plan")


@pytest.mark.parametrize("argv,message", [
    (["--model", MIXTRAL["8x7b"], "--ep", "3"],
     "--ep = 3: must divide model.num_experts = 8 (each expert-parallel rank holds num_experts / ep experts). "
     "Fix: use one of [1, 2, 4, 8]"),
    (["--model", MIXTRAL["8x7b"], "--nodes", "8", "--tp", "8", "--pp", "8", "--ep", "2"],  # dp 1
     "--ep = 2: must divide the data-parallel size (expert ranks are data-parallel ranks), and no valid layout of "
     "64 GPUs with the other options has such a dp. Fix: lower --ep, or pin --tp/--cp/--pp"),
    (["--model", "tiny-llama", "--gpu", "cpu", "--ep", "2"],
     "--ep = 2: expert parallelism needs experts (model.num_experts is unset). Fix: drop --ep"),
])
def test_an_impossible_ep_is_refused_with_the_rule_and_a_fix(plan, capsys, argv, message):
    assert plan.main(argv) == 2
    assert message in capsys.readouterr().err


def test_ep_pins_the_search(plan, capsys):
    assert plan.main(["--model", TINY, "--gpu", "cpu", "--gpus-per-node", "4", "--ep", "2", "--emit"]) == 0
    assert "parallel.ep=2" in capsys.readouterr().out.split()
