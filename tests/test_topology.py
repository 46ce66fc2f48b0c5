"""Topology arithmetic against hand-written expectations, and real groups on 8 gloo ranks."""
import pytest
import torch
import torch.distributed as dist

from megatron_domino import mpu
from megatron_domino.parallel import ParallelState, Topology
from tests.harness import run_ranks

# (tp, pp, dp, order) -> expected groups, written out by hand from "innermost axis first".
EXPECTED = {
    (2, 2, 2, "tp-cp-dp-pp"): dict(
        tp=[[0, 1], [2, 3], [4, 5], [6, 7]], dp=[[0, 2], [1, 3], [4, 6], [5, 7]],
        pp=[[0, 4], [1, 5], [2, 6], [3, 7]], mp=[[0, 1, 4, 5], [2, 3, 6, 7]],
        emb=[[0, 4], [1, 5], [2, 6], [3, 7]]),
    (4, 1, 2, "tp-cp-dp-pp"): dict(
        tp=[[0, 1, 2, 3], [4, 5, 6, 7]], dp=[[0, 4], [1, 5], [2, 6], [3, 7]],
        pp=[[r] for r in range(8)], mp=[[0, 1, 2, 3], [4, 5, 6, 7]], emb=[[r] for r in range(8)]),
    (1, 4, 2, "tp-cp-dp-pp"): dict(
        tp=[[r] for r in range(8)], dp=[[0, 1], [2, 3], [4, 5], [6, 7]],
        pp=[[0, 2, 4, 6], [1, 3, 5, 7]], mp=[[0, 2, 4, 6], [1, 3, 5, 7]], emb=[[0, 6], [1, 7]]),
    (2, 1, 1, "tp-cp-dp-pp"): dict(
        tp=[[0, 1]], dp=[[0], [1]], pp=[[0], [1]], mp=[[0, 1]], emb=[[0], [1]]),
    (2, 2, 2, "tp-cp-pp-dp"): dict(
        tp=[[0, 1], [2, 3], [4, 5], [6, 7]], dp=[[0, 4], [1, 5], [2, 6], [3, 7]],
        pp=[[0, 2], [1, 3], [4, 6], [5, 7]], mp=[[0, 1, 2, 3], [4, 5, 6, 7]],
        emb=[[0, 2], [1, 3], [4, 6], [5, 7]]),
}

# (tp, cp, pp, dp) in the default order tp-cp-dp-pp -> expected groups, by hand.
CP_EXPECTED = {
    (2, 2, 2, 1): dict(tp=[[0, 1], [2, 3], [4, 5], [6, 7]], cp=[[0, 2], [1, 3], [4, 6], [5, 7]],
                       dp=[[r] for r in range(8)], dp_cp=[[0, 2], [1, 3], [4, 6], [5, 7]],
                       pp=[[0, 4], [1, 5], [2, 6], [3, 7]]),
    (2, 2, 1, 2): dict(tp=[[0, 1], [2, 3], [4, 5], [6, 7]], cp=[[0, 2], [1, 3], [4, 6], [5, 7]],
                       dp=[[0, 4], [1, 5], [2, 6], [3, 7]], dp_cp=[[0, 2, 4, 6], [1, 3, 5, 7]],
                       pp=[[r] for r in range(8)]),
    (1, 4, 1, 2): dict(tp=[[r] for r in range(8)], cp=[[0, 1, 2, 3], [4, 5, 6, 7]],
                       dp=[[0, 4], [1, 5], [2, 6], [3, 7]], dp_cp=[list(range(8))], pp=[[r] for r in range(8)]),
}


# (tp, cp, pp, dp, ep) in the default order -> expected expert groups, by hand: ep consecutive dp ranks share
# the experts out; ranks with the same share (dp % ep, any cp) replicate them.
EP_EXPECTED = {
    (2, 1, 1, 4, 2): dict(ep=[[0, 2], [1, 3], [4, 6], [5, 7]], expert_dp=[[0, 4], [1, 5], [2, 6], [3, 7]]),
    (1, 2, 1, 4, 2): dict(ep=[[0, 2], [1, 3], [4, 6], [5, 7]], expert_dp=[[0, 1, 4, 5], [2, 3, 6, 7]]),
    (1, 1, 2, 4, 4): dict(ep=[[0, 1, 2, 3], [4, 5, 6, 7]], expert_dp=[[r] for r in range(8)]),
}


@pytest.mark.parametrize("layout", list(EP_EXPECTED), ids=lambda l: "tp{}-cp{}-pp{}-dp{}-ep{}".format(*l))
def test_expert_parallel_groups_match_hand_written_layout(layout):
    tp, cp, pp, dp, ep = layout
    topo = Topology(tp * cp * pp * dp, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep)
    assert topo.ep_groups() == EP_EXPECTED[layout]["ep"]
    assert topo.expert_dp_groups() == EP_EXPECTED[layout]["expert_dp"]
    for group in topo.ep_groups():  # members in ep order: the share a member holds is its dp % ep
        assert [topo.coordinate(r).dp % ep for r in group] == list(range(ep))
    assert topo.expert_groups() == topo.ep_groups()  # experts split over TP: tokens travel within the ep group


def test_whole_experts_are_shared_out_over_tp_and_ep():
    """Expert TP 1 at tp 2 x dp 4 x ep 2 (rank = tp + 2 * dp): each tp x ep block of 4 neighbours exchanges tokens;
    replicas stay those of the same TP rank and share."""
    topo = Topology(8, tp=2, dp=4, ep=2, expert_tp=1)
    assert topo.expert_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.expert_dp_groups() == EP_EXPECTED[(2, 1, 1, 4, 2)]["expert_dp"]
    with pytest.raises(ValueError, match="parallel.expert_tp = 3: must be 1 or parallel.tp = 2"):
        Topology(8, tp=2, dp=4, ep=2, expert_tp=3)


@pytest.mark.parametrize("layout", list(CP_EXPECTED), ids=lambda l: "tp{}-cp{}-pp{}-dp{}".format(*l))
def test_context_parallel_groups_match_hand_written_layout(layout):
    tp, cp, pp, dp = layout
    topo = Topology(tp * cp * pp * dp, tp=tp, pp=pp, dp=dp, cp=cp)
    want = CP_EXPECTED[layout]
    assert topo.tp_groups() == want["tp"] and topo.cp_groups() == want["cp"]
    assert topo.dp_groups() == want["dp"] and topo.dp_cp_groups() == want["dp_cp"]
    assert sorted(topo.pp_groups()) == want["pp"]
    for rank in range(topo.world_size):
        c = topo.coordinate(rank)
        assert topo.rank_of(tp=c.tp, pp=c.pp, dp=c.dp, cp=c.cp) == rank
        ring = next(g for g in topo.cp_groups() if rank in g)
        assert ring[c.cp] == rank  # the ring runs in cp order
    with pytest.raises(ValueError, match=r"parallel.order = 'tp-dp-pp'.*permutation of tp, cp, dp, pp"):
        Topology(8, tp=2, pp=2, order="tp-dp-pp")  # every axis named, cp too


@pytest.mark.parametrize("layout", list(EXPECTED), ids=lambda l: "tp{}-pp{}-dp{}-{}".format(*l))
def test_groups_match_hand_written_layout(layout):
    tp, pp, dp, order = layout
    topo = Topology(tp * pp * dp, tp=tp, pp=pp, dp=dp, order=order)
    want = EXPECTED[layout]
    assert topo.tp_groups() == want["tp"]
    assert topo.dp_groups() == want["dp"]
    assert sorted(topo.pp_groups()) == want["pp"]
    assert topo.model_parallel_groups() == want["mp"]
    assert sorted(topo.embedding_groups()) == want["emb"]
    for rank in range(topo.world_size):
        c = topo.coordinate(rank)
        assert topo.rank_of(tp=c.tp, pp=c.pp, dp=c.dp) == rank
        pipeline = next(g for g in topo.pp_groups() if rank in g)
        assert pipeline[c.pp] == rank
        assert topo.is_first_stage(rank) == (c.pp == 0)
        assert topo.is_last_stage(rank) == (c.pp == pp - 1)
        assert topo.next_pp_rank(rank) == pipeline[(c.pp + 1) % pp]
        assert topo.prev_pp_rank(rank) == pipeline[(c.pp - 1) % pp]


def test_dp_inferred_and_rank_map():
    topo = Topology(16, tp=2, pp=4)
    assert topo.dp == 2
    table = topo.rank_map()
    assert "world 16 = tp 2 x cp 1 x pp 4 x dp 2" in table and len(table.splitlines()) == 18


@pytest.mark.parametrize("kwargs, key", [
    (dict(world_size=8, tp=3), "parallel.dp = None: null infers world_size"),
    (dict(world_size=8, tp=2, cp=3), "parallel.dp = None: null infers world_size"),
    (dict(world_size=8, cp=0), "parallel.cp"),
    (dict(world_size=8, tp=2, pp=2, dp=3), "parallel.dp"),
    (dict(world_size=8, tp=0), "parallel.tp"),
    (dict(world_size=8, order="tp-pp"), "parallel.order"),
    (dict(world_size=8, dp=8, ep=3), "parallel.ep"),
    (dict(world_size=8, ep=0), "parallel.ep"),
])
def test_bad_layouts_are_refused(kwargs, key):
    with pytest.raises(ValueError, match=key.replace("*", r"\*").replace(".", r"\.")):
        Topology(**kwargs)


def _check_real_groups(rank, world_size):
    """One spawn, many checks: every group's all-reduce sums exactly its members, per layout."""
    for (tp, pp, dp, order), want in EXPECTED.items():
        if tp * pp * dp != world_size:
            continue
        ps = mpu.use(ParallelState(Topology(world_size, tp=tp, pp=pp, dp=dp, order=order)))
        for name, group in (("tp", ps.tp_group), ("dp", ps.dp_group), ("pp", ps.pp_group),
                            ("mp", ps.mp_group), ("emb", ps.embedding_group)):
            members = next((g for g in want[name] if rank in g), None)
            if members is None:  # middle pipeline stages hold no embedding
                assert name == "emb" and group is None
                continue
            value = torch.tensor([float(rank)])
            dist.all_reduce(value, group=group)
            assert value.item() == sum(members), ((tp, pp, dp, order), name, value, members)
        assert mpu.get_tensor_model_parallel_world_size() == tp
        assert mpu.get_tensor_model_parallel_rank() == ps.topology.coordinate(rank).tp
        assert mpu.get_pipeline_model_parallel_world_size() == pp
        assert mpu.get_data_parallel_world_size() == dp
        assert mpu.get_data_parallel_rank() == ps.topology.coordinate(rank).dp
        assert mpu.is_pipeline_first_stage() == (ps.pp_rank == 0)
        assert mpu.is_pipeline_last_stage() == (ps.pp_rank == pp - 1)
        assert mpu.get_model_parallel_world_size() == tp * pp
        assert mpu.get_pipeline_model_parallel_first_rank() == ps.pp_ranks[0]
        assert mpu.get_pipeline_model_parallel_next_rank() == ps.topology.next_pp_rank(rank)
        mpu.use(None)
        ps.destroy()
    for (tp, cp, pp, dp), want in CP_EXPECTED.items():
        ps = mpu.use(ParallelState(Topology(world_size, tp=tp, pp=pp, dp=dp, cp=cp)))
        for name, group in (("cp", ps.cp_group), ("dp_cp", ps.dp_cp_group), ("pp", ps.pp_group)):
            members = next(g for g in want[name] if rank in g)
            value = torch.tensor([float(rank)])
            dist.all_reduce(value, group=group)
            assert value.item() == sum(members), ((tp, cp, pp, dp), name, value, members)
        assert mpu.get_context_parallel_world_size() == cp and ps.cp_ranks == next(g for g in want["cp"] if rank in g)
        assert mpu.get_context_parallel_rank() == ps.topology.coordinate(rank).cp
        mpu.use(None)
        ps.destroy()
    for (tp, cp, pp, dp, ep), want in EP_EXPECTED.items():
        ps = mpu.use(ParallelState(Topology(world_size, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep)))
        for name, group in (("ep", ps.ep_group), ("expert_dp", ps.expert_dp_group)):
            members = next(g for g in want[name] if rank in g)
            value = torch.tensor([float(rank)])
            dist.all_reduce(value, group=group)
            assert value.item() == sum(members), ((tp, cp, pp, dp, ep), name, value, members)
        assert mpu.get_expert_model_parallel_world_size() == ep and mpu.get_expert_model_parallel_group() is ps.ep_group
        assert mpu.get_expert_model_parallel_rank() == dist.get_rank(ps.ep_group)
        assert mpu.get_expert_data_parallel_group() is ps.expert_dp_group
        mpu.use(None)
        ps.destroy()
    assert not mpu.model_parallel_is_initialized()
    table = mpu.initialize_model_parallel(2, 2).rank_map()
    assert mpu.get_data_parallel_world_size() == 2
    _megatron_style_lookup()
    mpu.destroy_model_parallel()
    return table


def _megatron_style_lookup():
    """Code written for Megatron-LM, unchanged: a vocab-parallel embedding lookup (each TP rank holds a slice of the
    table, masks the tokens outside it and the TP group sums), then a data-parallel gradient average, through mpu
    alone. Equals the whole table's lookup."""
    vocab, hidden = 8, 3
    table = torch.arange(vocab * hidden, dtype=torch.float32).view(vocab, hidden)
    per_rank = vocab // mpu.get_tensor_model_parallel_world_size()
    first = mpu.get_tensor_model_parallel_rank() * per_rank
    tokens = torch.tensor([0, 3, 5, 7])
    outside = (tokens < first) | (tokens >= first + per_rank)
    local = table[first:first + per_rank][(tokens - first).masked_fill(outside, 0)]
    local[outside] = 0.0
    dist.all_reduce(local, group=mpu.get_tensor_model_parallel_group())
    assert torch.equal(local, table[tokens])
    grad = torch.full((1,), float(mpu.get_data_parallel_rank()))
    dist.all_reduce(grad, group=mpu.get_data_parallel_group())
    assert grad.item() == sum(range(mpu.get_data_parallel_world_size()))


def test_eight_real_ranks_collective_on_every_group():
    tables = run_ranks(_check_real_groups, 8, timeout=120)
    assert "world 8 = tp 2 x cp 1 x pp 2 x dp 2" in tables[0]


def test_mpu_stage_questions_under_interleaving_need_ignore_virtual():
    """Megatron answers is_pipeline_first_stage() (ignore_virtual=False) from its current virtual stage; this
    library keeps none, so with virtual_pp > 1 that form is refused, saying how to ask instead."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mpu.use(ParallelState(Topology(2, pp=2, virtual_pp=2)))
        assert not mpu.is_pipeline_first_stage(ignore_virtual=True) and mpu.is_pipeline_last_stage(True)
        with pytest.raises(NotImplementedError, match="ignore_virtual=True"):
            mpu.is_pipeline_first_stage()
        mpu.use(ParallelState(Topology(2, pp=2)))
        assert mpu.is_pipeline_last_stage() and not mpu.is_pipeline_first_stage()
        mpu.use(None)
    finally:
        dist.destroy_process_group()
