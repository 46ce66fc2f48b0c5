"""DeepSeek-V3's routing: aux-loss-free balancing's bias update against its closed form on 4 ranks (every rank
applies the same update), saved and resumed with the weights; group-limited routing, the routed scaling factor,
leading dense layers and a shared expert under TP with Domino, the pipeline (ZB-H1) and EP, like one process.
The selection's closed form: tests/test_moe.py."""
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from megatron_domino.config import ConfigError
from megatron_domino.config.loader import load_config
from megatron_domino.models import LanguageModel, initialize_weights
from megatron_domino.models.expert_bias import update_expert_biases
from megatron_domino.validation import validate_config
from tests.harness import run_ranks
from tests.test_expert_parallel import _config as ep_config, _run as ep_run
from tests.test_moe import LLAMA_MOE
from tests.test_pipeline import MICRO_BATCH
from tests.test_zero3 import _covered
from tests.training_runs import REPO, TINY, losses, metrics, train

pytestmark = pytest.mark.slow  # multi-rank

RATE = 0.01
DEEPSEEK = replace(LLAMA_MOE, num_layers=4, num_experts=8, moe_topk=2, moe_n_group=4, moe_topk_group=2,
                   moe_router="sigmoid", moe_routed_scaling_factor=2.5, moe_first_k_dense=1, moe_shared_experts=1,
                   moe_capacity_factor=None, moe_router_bias_update_rate=RATE)


def _check_update(rank, world):
    group = dist.new_group(list(range(world)))
    model = LanguageModel(DEEPSEEK)
    initialize_weights(model, seed=3)
    layers = [layer for _, layer in model.moe_layers()]
    assert len(layers) == DEEPSEEK.num_layers - 1  # the first layer stays dense
    expected = torch.zeros(len(layers), 8)
    for step in range(2):
        loads = torch.stack([torch.arange(8.0).roll(rank + step + i) * (rank + 1) for i in range(len(layers))])
        for layer, load in zip(layers, loads):
            layer.stats.values[:8] = load
        update_expert_biases([model], group)
        total = sum(torch.stack([torch.arange(8.0).roll(r + step + i) * (r + 1) for i in range(len(layers))])
                    for r in range(world))
        expected += RATE * torch.sign(total.mean(dim=1, keepdim=True) - total)
        for layer, want in zip(layers, expected):
            assert torch.equal(layer.router.expert_bias.detach(), want.to(torch.float32)), (rank, step)
    return True


def test_bias_update_equals_its_closed_form_on_4_ranks():
    """bias += rate * sign(mean load - load), the load summed over the 4 data-parallel ranks: two steps."""
    assert all(run_ranks(_check_update, 4, timeout=120))


EP = [(ep_config(DEEPSEEK, ep=2, dp=2, tp=2, domino=True), MICRO_BATCH),
      (ep_config(DEEPSEEK, ep=2, dp=2, pp=2, pipeline_schedule="zb-h1"), MICRO_BATCH)]


def _check_ep(rank, world):
    return ep_run(world, EP)


def test_deepseek_routing_composes_with_tp_domino_pipeline_and_ep():
    """4 ranks: tp 2 × dp 2 × ep 2 with Domino, pp 2 × dp 2 × ep 2 under ZB-H1; sigmoid scores, 8 experts in 4
    groups (2 per token), gates × 2.5, a shared expert, layer 0 dense. 6 SGD steps, 1e-5 of one process."""
    _covered(EP, run_ranks(_check_ep, 4, timeout=300))


def test_the_bias_balances_is_logged_and_resumes_with_the_checkpoint(tmp_path):
    """The tiny Mixtral with aux-loss-free balancing, dp 2: the bias moves and is logged with the unbiased
    shares; a run resumed from step 3 continues with the saved bias (its losses and bias equal the
    uninterrupted run's)."""
    common = ["train.steps=6", "train.global_batch_size=8", "log.interval=1", "parallel.dp=2",
              "model.moe_router_bias_update_rate=0.05", "model.moe_aux_loss_coeff=0.0"]
    base = str(tmp_path / "base")
    train("mixtral", 2, base, [*common, "checkpoint.interval=3"])
    records = metrics(base)
    assert records[0]["moe_expert_bias_max"] > 0 > records[0]["moe_expert_bias_min"]
    assert "moe_unbiased_share_max" in records[-1]
    run = str(tmp_path / "resumed")
    train("mixtral", 2, run, [*common, f"checkpoint.load={base}/checkpoints/step_00000003",
                              "checkpoint.save_at_end=false"])
    reference, resumed = losses(base), losses(run)
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6), step
    assert metrics(run)[-1]["moe_expert_bias_max"] == pytest.approx(records[-1]["moe_expert_bias_max"], rel=1e-6)


@pytest.mark.quick
@pytest.mark.parametrize("overrides, key", [
    (["model.moe_n_group=4", "model.moe_topk_group=5"], "model.moe_topk_group"),  # more groups than there are
    (["model.moe_n_group=3", "model.moe_topk_group=1"], "model.moe_n_group"),  # 3 does not divide 4 experts
    (["model.moe_n_group=4"], "model.moe_n_group / model.moe_topk_group"),  # one without the other
    (["model.moe_n_group=4", "model.moe_topk_group=1"], "model.moe_topk_group"),  # 1 expert left for top-2
    (["model.moe_routed_scaling_factor=0"], "model.moe_routed_scaling_factor"),
    (["model.moe_first_k_dense=9"], "model.moe_first_k_dense"),
    (["model.moe_router_bias_update_rate=-1"], "model.moe_router_bias_update_rate"),
])
def test_bad_routing_settings_are_refused_before_any_group(no_process_group, overrides, key):
    cfg = load_config(f"{REPO}/{TINY['mixtral']}", ["data.mock=true", *overrides])
    with pytest.raises(ConfigError) as error:
        validate_config(cfg, world_size=1, check_paths=False)
    assert key in str(error.value), str(error.value)
