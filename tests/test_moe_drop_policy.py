"""Which assignments a full expert keeps (``model.moe_token_drop_policy``): the first tokens (``position``), the
likeliest (``probs``), or a random choice (``random``) that every TP rank routing the same tokens makes alike, that
changes from one routing to the next, and that recompute replays."""
from dataclasses import replace

import pytest
import torch

from megatron_domino.config import ConfigError, load_config
from megatron_domino.models import moe as moe_module
from megatron_domino.models.moe import MoE
from megatron_domino.models.router import route, within_capacity
from megatron_domino.models.recompute import recompute
from megatron_domino.parallel.random import RNGTracker
from megatron_domino.tensor_parallel import LayerContext
from megatron_domino.validation import validate_config
from tests.harness import run_ranks
from tests.test_moe import E, GPT_MOE, K
from tests.training_runs import REPO, TINY


def _queue_reference(experts, capacity, priority):
    """Per expert, its assignments sorted by descending priority (ties: token order); the first ``capacity`` kept."""
    kept = [[False] * K for _ in experts]
    for e in range(E):
        mine = [(t, j) for t, row in enumerate(experts.tolist()) for j, x in enumerate(row) if x == e]
        for t, j in sorted(mine, key=lambda tj: (-priority[tj].item(), tj[0]))[:capacity]:
            kept[t][j] = True
    return kept


@pytest.mark.quick
def test_a_priority_queue_keeps_each_experts_highest_priorities():
    g = torch.Generator().manual_seed(2)
    experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(30)])
    priority = torch.randint(0, 5, experts.shape, generator=g).float()  # ties too
    for capacity in (0, 2, 9, 30):
        assert within_capacity(experts, E, capacity, priority).tolist() == _queue_reference(experts, capacity,
                                                                                            priority)


@pytest.mark.quick
def test_probs_keeps_the_likeliest_and_position_the_first():
    logits = torch.randn(40, E, generator=torch.Generator().manual_seed(3)) * 3
    by_probs, by_position = (route(logits, K, "softmax", 0.5, drop_policy=p) for p in ("probs", "position"))
    gates = torch.softmax(logits, -1).gather(1, by_probs.experts)
    assert by_probs.kept.tolist() == _queue_reference(by_probs.experts, 10, gates)
    assert by_position.kept.tolist() == within_capacity(by_position.experts, E, 10).tolist()
    assert by_probs.kept.tolist() != by_position.kept.tolist()
    assert (by_probs.kept.sum(), by_position.kept.sum()) == (40, 40)  # C = ceil(40 * 2 * 0.5 / 4) = 10 per expert


def _kept_masks(rank, world_size):
    """tp 2 (experts split): the kept masks of three routings of the same tokens, the third under recompute."""
    import torch.distributed as dist
    cfg = replace(GPT_MOE, moe_capacity_factor=0.5, moe_token_drop_policy="random")
    rng = RNGTracker.seeded(11, tp_rank=rank)
    layer = MoE(cfg, LayerContext(group=dist.group.WORLD, rng=rng))
    torch.manual_seed(0)  # the same weights and tokens on both ranks (then the run's default stream again)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(4, cfg.seq_length, cfg.hidden_size, requires_grad=True)
    RNGTracker.seeded(11, tp_rank=rank)
    masks, original = [], moe_module.route
    moe_module.route = lambda *args: _recorded(original, masks, *args)
    try:
        layer.hidden(x)
        with rng.fork():  # a TP-stream draw in between (dropout on this rank's heads) changes nothing
            torch.rand(rank + 1)
        layer.hidden(x)
        out = recompute(lambda v: layer.project(layer.hidden(v))[0], x, rng=rng)
        out.sum().backward()  # the backward replays the third routing
    finally:
        moe_module.route = original
    gathered = [torch.zeros_like(masks[0], dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(gathered, masks[0].to(torch.uint8))
    return [m.tolist() for m in masks], [g.tolist() for g in gathered]


def _recorded(original, masks, *args):
    routing = original(*args)
    masks.append(routing.kept)
    return routing


@pytest.mark.slow
def test_random_drops_agree_across_tp_change_per_routing_and_replay_under_recompute():
    (masks0, gathered), (masks1, _) = run_ranks(_kept_masks, 2, timeout=120)
    assert masks0 == masks1 and gathered[0] == gathered[1]  # both TP ranks drop the same assignments
    first, second, recomputed_forward, replayed = masks0
    assert first != second  # a fresh draw per routing (per micro-batch and step)
    assert recomputed_forward == replayed  # recompute draws what the forward drew
    total = len(first) * K
    assert 0 < sum(map(sum, first)) < total  # some kept, some dropped


@pytest.mark.quick
def test_an_unknown_drop_policy_is_refused_before_any_group():
    cfg = load_config(f"{REPO}/{TINY['mixtral']}", ["data.mock=true", "model.moe_token_drop_policy=gumbel"])
    with pytest.raises(ConfigError, match="model.moe_token_drop_policy"):
        validate_config(cfg, world_size=1, check_paths=False)
