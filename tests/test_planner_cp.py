"""The planner with context parallelism: memory per rank, the ring's and the all-to-alls' communication
(``planner/context_parallel.py``), the search over cp and cp_comm, and the long-context Llama configs, whose
layouts and CP communication must be the planner's own first choices."""
from __future__ import annotations

import os
import re
from dataclasses import replace

import pytest

from megatron_domino.config import load_config
from megatron_domino.validation import validate_config
from megatron_domino.planner.hardware import get_gpu
from megatron_domino.planner.activations import chunk_activation_bytes
from megatron_domino.planner.context_parallel import Link, context_parallel_seconds, exchange_bytes, nested_seconds
from megatron_domino.planner.memory import estimate_memory, rank_parameters
from megatron_domino.planner.report import format_table
from megatron_domino.planner.search import candidate_layouts, evaluate, first_valid, is_valid, rank_layouts
from megatron_domino.planner.timing import estimate_step_time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA, GPT = os.path.join(ROOT, "configs/tiny/llama.yaml"), os.path.join(ROOT, "configs/tiny/gpt.yaml")
LONG = {name: os.path.join(ROOT, "configs/llama", name) for name in ("llama3.1-8b-32k.yaml", "llama3.1-8b-128k.yaml")}
H100 = get_gpu("h100-80gb")
NVLINK, IB = Link(450e9, 5e-6), Link(50e9, 15e-6)  # H100's links with the default latency guesses
RATE = 989e12 * 0.5  # achieved FLOP/s at the default efficiency


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
    kv, grads = 15e-6 + elements * 2 / 50e9, 15e-6 + elements * 4 / 50e9  # bf16 K/V, fp32 dK/dV, one message each
    forward = (cp - 1) * (kv - block)
    backward = (cp - 1) * (kv + grads - 2 * block) + grads  # dK/dV hops travel beside the next step's K/V
    assert kv > 2 * block and across.cp_exposed == pytest.approx(m * layers * (forward + backward), rel=1e-9)
    moved = m * layers * (2 * (cp - 1) * kv + cp * grads)
    assert across.cp_exposed + across.cp_hidden == pytest.approx(moved, rel=1e-9)
    selective = _ring(2, "selective")[1]  # the forward ring runs again
    assert selective.cp_exposed == pytest.approx(m * layers * (2 * forward + backward), rel=1e-9)
    inside = _ring(gpus_per_node=8)[1]  # NVLink: the K/V steps hide behind the attention, the backward steps
    kv, grads = 5e-6 + elements * 2 / 450e9, 5e-6 + elements * 4 / 450e9  # but for their start-ups; the last hop not
    assert kv < block and inside.cp_exposed == pytest.approx(m * layers * ((cp - 1) * (kv + grads - 2 * block) + grads),
                                                             rel=1e-9)


def _comm(comm, *overrides, gpus_per_node=8):
    """A cp 4 layout of 4096 tokens with ``parallel.cp_comm=comm`` (``comm`` "a2a+ring:2": groups of 2) and its
    step time."""
    comm, _, size = comm.partition(":")
    cfg = _long("model.seq_length=4096", "parallel.tp=1", "parallel.cp=4", "parallel.sequence_parallel=false",
                "parallel.domino=false", "train.global_batch_size=8", f"parallel.cp_comm={comm}",
                *([f"parallel.cp_a2a_size={size}"] if size else []), *overrides)
    return cfg, estimate_step_time(cfg, 1, H100, gpus_per_node)


def test_all_to_all_volume_and_time_match_a_hand_count():
    m, layers = 8, 32
    cfg, step = _comm("a2a")
    # 1024 local tokens, bf16: Q 32 heads x 128 = 8 MiB, K and V 8 groups = 2 MiB each, the output 8 MiB
    assert exchange_bytes(cfg, 4) == 20 * 2**20
    sent = 3 / 4 * 20 * 2**20  # a rank keeps its own quarter
    one_pass = 4 * 3 * 5e-6 + sent / 450e9  # Q, K, V and the output, 3 peers each, over NVLink
    assert step.cp_exposed == pytest.approx(m * layers * 2 * one_pass, rel=1e-9)  # forward and backward
    assert step.cp_hidden == 0  # nothing overlaps the all-to-alls today
    recomputed = _comm("a2a", "model.recompute=selective")[1]  # the recomputed forward repeats them
    assert recomputed.cp_exposed == pytest.approx(m * layers * 3 * one_pass, rel=1e-9)
    # tp 4: 8 heads and 2 K/V groups per TP rank; the groups are repeated to 4, one per all-to-all rank
    assert exchange_bytes(_comm("a2a", "parallel.tp=4")[0], 4) == 2 * 1024 * 128 * (8 + 4 + 4 + 8)
    across = _comm("a2a", gpus_per_node=2)[1]  # the 4 ranks span two nodes: InfiniBand's bandwidth and latency
    assert across.cp_exposed == pytest.approx(m * layers * 2 * (4 * 3 * 15e-6 + sent / 50e9), rel=1e-9)


def test_a2a_plus_ring_degenerates_to_the_ring_and_to_the_all_to_all():
    ring, a2a, nested = (_comm(c)[0] for c in ("ring", "a2a", "a2a+ring:2"))
    for cfg in (ring, a2a, nested):  # the group size decides, not the config's cp_comm
        assert nested_seconds(cfg, RATE, NVLINK, IB, 1) == context_parallel_seconds(ring, RATE, NVLINK, IB)
        assert nested_seconds(cfg, RATE, NVLINK, IB, 4) == context_parallel_seconds(a2a, RATE, NVLINK, IB)
    # groups of 2 inside a node (NVLink), a ring of 2 members across two nodes (InfiniBand): each member holds
    # 2048 tokens, each rank 16 heads and 4 K/V groups of them
    elements = 2 * 2048 * 4 * 128
    kv, grads = 15e-6 + elements * 2 / 50e9, 15e-6 + elements * 4 / 50e9
    block = 2 * 16 * 128 * 2048 * 4096 / 2 / RATE
    ring_part = max(0, kv - block) + max(0, kv + grads - 2 * block) + grads
    a2a_part = 2 * (4 * 1 * 5e-6 + exchange_bytes(nested, 2) / 2 / 450e9)
    assert nested_seconds(nested, RATE, NVLINK, IB, 2)[0] == pytest.approx(ring_part + a2a_part, rel=1e-12)
    step = _comm("a2a+ring:2", gpus_per_node=2)[1]  # the topology's groups: {0, 1}, {2, 3}; rings {0, 2}, {1, 3}
    assert step.cp_exposed == pytest.approx(8 * 32 * (ring_part + a2a_part), rel=1e-9)


def test_a2a_wins_where_the_ring_cannot_hide_its_hops_and_the_ring_where_it_can():
    # 4096 tokens, every rank on its own node: a ring hop (4 MiB over InfiniBand, 99 us) outlasts its block of
    # attention (17 us), so all the hops show; the all-to-alls send less than the ring's 3 hops forward and back
    ring, a2a = (_comm(c, gpus_per_node=1)[1] for c in ("ring", "a2a"))
    assert a2a.cp_exposed < 0.9 * ring.cp_exposed and a2a.total < ring.total
    cfg = _comm("ring")[0]
    ranked = rank_layouts(cfg, H100, 4, 1, only={"tp": [1], "cp": [4], "pp": [1], "cp_comm": ["ring", "a2a"]})
    assert first_valid(cfg, (e for e in ranked if e.fits), 1)[0].layout.cp_comm == "a2a"
    # 128K tokens over cp 16 on two nodes: the ring's hops hide behind 8192-token blocks; an all-to-all cannot
    long = load_config(LONG["llama3.1-8b-128k.yaml"])
    times = {lay.cp_mode: evaluate(long, lay, H100, 8).time for lay in candidate_layouts(
        long, 32, only={"tp": [1], "cp": [16], "pp": [1], "micro_batch": [1], "recompute": ["none"],
                        "zero_stage": [3], "domino": [True]})}
    assert set(times) == {"ring", "a2a", "a2a2+ring", "a2a4+ring", "a2a8+ring"}
    assert min(times, key=lambda mode: times[mode].total) == "ring"
    assert all(times["ring"].cp_exposed < 0.8 * t.cp_exposed for mode, t in times.items() if mode != "ring")


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


def test_search_tries_every_cp_comm_the_config_rules_accept_and_nothing_else():
    """Tiny GPT, 4 heads: an all-to-all group of n ranks needs n to divide a TP rank's heads; a2a+ring's group
    size lies strictly between 1 and cp; the ring needs the flash kernels."""
    only = {"recompute": ["none"], "micro_batch": [1], "zero_stage": [1], "virtual_pp": [1]}
    cfg = load_config(GPT)
    layouts = candidate_layouts(cfg, 8, only)
    modes: dict = {}
    for lay in layouts:
        modes.setdefault((lay.tp, lay.cp), set()).add(lay.cp_mode)
    assert modes == {(1, 1): {"-"}, (2, 1): {"-"}, (4, 1): {"-"}, (1, 2): {"ring", "a2a"},
                     (1, 4): {"ring", "a2a", "a2a2+ring"}, (1, 8): {"ring", "a2a2+ring", "a2a4+ring"},
                     (2, 2): {"ring", "a2a"}, (2, 4): {"ring", "a2a2+ring"}, (4, 2): {"ring"}}
    assert all(is_valid(cfg, lay) for lay in layouts)
    nested = next(lay for lay in layouts if lay.cp_mode == "a2a4+ring")
    assert {"parallel.cp_comm=a2a+ring", "parallel.cp_a2a_size=4"} <= set(nested.overrides())
    assert load_config(GPT, nested.overrides()) == nested.apply(cfg)
    pinned = load_config(GPT, ["model.attention_backend=efficient"])  # the ring cannot run it; the all-to-all can
    assert {lay.cp_mode for lay in candidate_layouts(pinned, 8, only) if lay.cp > 1} == {"a2a"}
    assert {lay.cp_mode for lay in candidate_layouts(cfg, 8, {**only, "cp_comm": ["a2a+ring"]})} == {
        "-", "a2a2+ring", "a2a4+ring"}  # the filter leaves layouts without CP alone
    ranked = rank_layouts(cfg, get_gpu("cpu"), 1, 8, only={**only, "cp": [8]})
    table = format_table(ranked, first_valid(cfg, ranked, 3))
    assert "cp-comm" in table and re.search(r"\n +1 +\d+ +8 .* (ring|a2a2\+ring|a2a4\+ring) +\|", table)


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


def _written_cp_comms(path):
    """The header's CP communication: (the cp_comm it says the planner picks, {GPUs: {mode: (step s, exposed s)}})
    from lines such as "8 GPUs: ring 102.9 s/step (0.326 s exposed), a2a 105.1 (2.48), ..." (wrapped or not)."""
    text = " ".join(line.lstrip("# ").strip() for line in open(path).read().splitlines() if line.startswith("#"))
    picked = re.search(r"the planner picks the \S+ \(parallel\.cp_comm: ([\w+]+)\)", text).group(1)
    entry = r"([a-z0-9+]+) ([\d.]+)(?: s/step)? \(([\d.]+)(?: s exposed)?\)"
    numbers = {int(found.group(1)): {mode: (float(step), float(exposed))
                                     for mode, step, exposed in re.findall(entry, found.group(2))}
               for found in re.finditer(rf"(\d+) GPUs: ((?:{entry}(?:, )?)+)", text)}
    return picked, numbers


@pytest.mark.slow  # 15 s each
@pytest.mark.parametrize("name", sorted(LONG))
def test_long_context_configs_hold_the_planners_first_choice(name):
    """The layout of each cluster, and the header's CP communication: the planner's pick, and every cp_comm the
    rules allow at that layout with its estimated step time and exposed CP communication."""
    path = LONG[name]
    base = load_config(path)
    picked, written = _written_cp_comms(path)
    for world, overrides in _written_layouts(path).items():
        ranked = rank_layouts(base, H100, world // 8, 8)
        best = first_valid(base, (e for e in ranked if e.fits), 1)
        if overrides is None:
            assert not best, f"{name}: the planner now finds a layout for {world} GPUs; write it into the file"
            continue
        cfg = load_config(path, overrides)
        assert validate_config(cfg, world_size=world, check_paths=False) == []
        assert best and best[0].layout.apply(cfg) == _filled(cfg, world), \
            f"{name} on {world} GPUs: the planner recommends {' '.join(best[0].layout.overrides())}"
        assert best[0].layout.cp_comm == picked
        ring_of = lambda lay: replace(lay, cp_comm="ring", cp_a2a_size=None)  # noqa: E731
        variants = {e.layout.cp_mode: e.time for e in ranked if ring_of(e.layout) == ring_of(best[0].layout)}
        assert set(written[world]) == set(variants), f"{name} on {world} GPUs: the header lists {set(written[world])}"
        for mode, (step, exposed) in written[world].items():
            assert (step, exposed) == pytest.approx((variants[mode].total, variants[mode].cp_exposed), rel=5e-3), \
                f"{name} on {world} GPUs, {mode}: est. {variants[mode].total:.4g} s/step, " \
                f"{variants[mode].cp_exposed:.3g} s exposed"
