"""The planner with context parallelism: memory per rank, ring attention's communication, the search over cp,
and the long-context Llama configs, whose layouts must be the planner's own first choices."""
from __future__ import annotations

import os
import re
from dataclasses import replace

import pytest

from megatron_domino.config import load_config
from megatron_domino.validation import validate_config
from megatron_domino.planner.hardware import get_gpu
from megatron_domino.planner.activations import chunk_activation_bytes
from megatron_domino.planner.memory import estimate_memory, rank_parameters
from megatron_domino.planner.report import format_table
from megatron_domino.planner.search import candidate_layouts, first_valid, rank_layouts
from megatron_domino.planner.timing import estimate_step_time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA, GPT = os.path.join(ROOT, "configs/tiny/llama.yaml"), os.path.join(ROOT, "configs/tiny/gpt.yaml")
LONG = {name: os.path.join(ROOT, "configs/llama", name) for name in ("llama3.1-8b-32k.yaml", "llama3.1-8b-128k.yaml")}
H100 = get_gpu("h100-80gb")


def _long(*overrides):
    return load_config(LONG["llama3.1-8b-32k.yaml"], list(overrides))


# ----- memory ------------------------------------------------------------------------------------
def test_activations_divide_by_cp_and_zero_shards_over_dp_times_cp():
    one = _long("parallel.tp=2", "parallel.cp=1", "optimizer.zero_stage=2")
    four = _long("parallel.tp=2", "parallel.cp=4", "optimizer.zero_stage=2")
    plain, split = estimate_memory(one, 1, H100), estimate_memory(four, 1, H100)
    assert split.activations == pytest.approx(plain.activations / 4)
    assert split.transient == pytest.approx(plain.transient / 4)  # the loss's logits, also per local token
    assert split.params == plain.params
    replicas = estimate_memory(one, 4, H100)  # dp 4 instead of cp 4: the same ZeRO shards
    assert (split.grads, split.optimizer) == pytest.approx((replicas.grads, replicas.optimizer))
    assert split.optimizer == pytest.approx(12 * rank_parameters(four)[0] / 4)
    # ZeRO-3 shards the weights over dp x cp as well: cp 4 holds what dp 4 does
    one, four = (_as_zero3(cfg) for cfg in (one, four))
    assert estimate_memory(four, 1, H100).params == pytest.approx(estimate_memory(one, 4, H100).params)
    assert estimate_memory(four, 1, H100).params < estimate_memory(one, 1, H100).params / 2


def _as_zero3(cfg):
    cfg.optimizer.zero_stage = 3
    return cfg


def test_document_masking_and_long_sequences_add_no_quadratic_term():
    short = _long("model.seq_length=8192", "data.reset_attention_mask=false")
    for cfg in (short, _long(), _long("model.seq_length=131072", "parallel.cp=16")):
        per_token = chunk_activation_bytes(cfg, H100, cfg.model.num_layers, True, True)
        assert per_token == chunk_activation_bytes(short, H100, short.model.num_layers, True, True)


# ----- ring attention's communication --------------------------------------------------------------
def _ring(gpus_per_node, recompute="none"):
    cfg = _long("model.seq_length=4096", "parallel.tp=1", "parallel.cp=4", "parallel.sequence_parallel=false",
                f"model.recompute={recompute}", "parallel.domino=false", "train.global_batch_size=8")
    return cfg, estimate_step_time(cfg, 1, H100, gpus_per_node)


def test_ring_transfers_hide_behind_block_attention_only_as_far_as_it_lasts():
    m, layers, cp, s = 8, 32, 4, 4096
    elements = 2 * (s // cp) * 8 * 128  # K and V of 1024 local tokens, 8 KV heads of 128
    block = 2 * 32 * 128 * s * s / cp**2 / (989e12 * 0.5)  # causal work of one ring step, forward
    cfg, across = _ring(gpus_per_node=2)  # the ring 0-1-2-3 spans two nodes: InfiniBand
    kv, grads = elements * 2 / 50e9, elements * 4 / 50e9  # bf16 K/V, fp32 dK/dV
    forward = (cp - 1) * (kv - block)
    backward = (cp - 1) * (kv + grads - 2 * block) + grads  # dK/dV hops travel beside the next step's K/V
    assert kv > 2 * block and across.cp_exposed == pytest.approx(m * layers * (forward + backward), rel=1e-9)
    moved = m * layers * (2 * (cp - 1) * kv + cp * grads)
    assert across.cp_exposed + across.cp_hidden == pytest.approx(moved, rel=1e-9)
    selective = _ring(2, "selective")[1]  # the forward ring runs again
    assert selective.cp_exposed == pytest.approx(m * layers * (2 * forward + backward), rel=1e-9)
    inside = _ring(gpus_per_node=8)[1]  # NVLink: K/V and dK/dV steps hide behind the attention; the last hop not
    assert inside.cp_exposed == pytest.approx(m * layers * elements * 4 / 450e9, rel=1e-9)


def test_gradients_reduce_over_dp_times_cp():
    cfg = _long("parallel.tp=1", "parallel.cp=8", "optimizer.zero_stage=0", "optimizer.overlap_grad_reduce=false")
    params = rank_parameters(cfg)[0]
    assert estimate_step_time(cfg, 1, H100, 8).dp_exposed == pytest.approx(2 * 7 / 8 * 4 * params / 450e9)
    assert estimate_step_time(cfg, 2, H100, 8).dp_exposed == pytest.approx(2 * 15 / 16 * 4 * params / 50e9)


# ----- the search --------------------------------------------------------------------------------
def test_search_tries_every_cp_that_splits_the_sequence_into_2cp_chunks():
    cfg = load_config(LLAMA, ["model.seq_length=40"])  # 2 * cp divides 40 for cp 1, 2 and 4, not 8
    layouts = candidate_layouts(cfg, 8)
    assert {lay.cp for lay in layouts} == {1, 2, 4}
    assert {lay.world_size for lay in layouts} == {8}
    ranked = rank_layouts(cfg, get_gpu("cpu"), 1, 8, only={"cp": [2], "tp": [2]})
    assert ranked and all((e.layout.cp, e.layout.tp * e.layout.pp * e.layout.dp) == (2, 4) for e in ranked)
    best = first_valid(cfg, ranked, 1)[0]
    assert "parallel.cp=2" in best.layout.overrides()
    assert load_config(LLAMA, ["model.seq_length=40", *best.layout.overrides()]) == best.layout.apply(cfg)
    table = format_table(ranked, [best])
    assert "  tp  cp  pp   dp" in table and re.search(rf"\n +1 +2 +2 +{best.layout.pp} +{best.layout.dp} ", table)
    with_dropout = load_config(GPT, ["model.attention_dropout=0.1"])  # ring attention has none
    assert {lay.cp for lay in candidate_layouts(with_dropout, 8)} == {1}


# ----- the long-context configs ------------------------------------------------------------------
def _filled(cfg, world):
    """``cfg`` with parallel.dp inferred from the world size, as the launcher does."""
    par = cfg.parallel
    return replace(cfg, parallel=replace(par, dp=par.dp or world // (par.tp * par.cp * par.pp)))


def _written_layouts(path):
    """{GPUs: overrides} from the header: the parallel section's cluster, and the other one's command (or None)."""
    text = open(path).read()
    in_file = int(re.search(r"The parallel section is the one for (\d+) GPUs", text).group(1))
    other = 32 if in_file == 8 else 8
    comments = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    overrides = re.findall(r"(?<!\S)([a-z_]+\.[a-z_]+=[^\s\\]+)", comments)
    return {in_file: [], other: overrides or None}


@pytest.mark.parametrize("name", sorted(LONG))
def test_long_context_configs_hold_the_planners_first_choice(name):
    path = LONG[name]
    base = load_config(path)
    for world, overrides in _written_layouts(path).items():
        best = first_valid(base, (e for e in rank_layouts(base, H100, world // 8, 8) if e.fits), 1)
        if overrides is None:
            assert not best, f"{name}: the planner now finds a layout for {world} GPUs; write it into the file"
            continue
        cfg = load_config(path, overrides)
        assert validate_config(cfg, world_size=world, check_paths=False) == []
        assert best and best[0].layout.apply(cfg) == _filled(cfg, world), \
            f"{name} on {world} GPUs: the planner recommends {' '.join(best[0].layout.overrides())}"
