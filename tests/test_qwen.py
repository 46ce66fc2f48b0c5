"""Qwen's pieces train like one process (fp32, 1e-5): QK-norm (Qwen3: an RMSNorm over each head's query and key,
its weight shared by heads that TP splits, so its gradient sums over TP), q/k/v biases without the others
(Qwen2), and Qwen3-MoE's unnormalised top-k gates, under TP with Domino (row split with SP, 2-D), the pipeline
(1F1B, ZB-H1), context parallelism and expert parallelism. HF conversion of the three families:
tests/test_convert.py."""
from dataclasses import replace

import pytest

from megatron_domino.config import ConfigError
from megatron_domino.config.loader import load_config
from megatron_domino.models import LanguageModel
from megatron_domino.validation import validate_config
from tests.harness import run_ranks
from tests.test_context_parallel import _layout as cp_layout
from tests.test_expert_parallel import _config as ep_config
from tests.test_moe import LLAMA_MOE
from tests.test_pipeline import LLAMA, MICRO_BATCH
from tests.test_zero3 import _check_layouts, _covered, _zero3
from tests.training_runs import REPO, TINY

pytestmark = pytest.mark.slow  # multi-rank training runs

QWEN3 = replace(LLAMA, qk_norm=True, kv_channels=8)  # head_dim 8: 8 heads x 8 = 64 != hidden 32, as in Qwen3
QWEN2 = replace(LLAMA, qkv_bias=True, tie_embeddings=True)
QWEN3_MOE = replace(LLAMA_MOE, qk_norm=True, moe_router="softmax", moe_shared_experts=0, moe_capacity_factor=None,
                    moe_norm_topk_prob=False)


FOUR = [_zero3(QWEN3, 2, 1, 2, zero_stage=1, domino=True, sequence_parallel=True),  # Domino rows + SP
        _zero3(QWEN2, 2, 1, 2, zero_stage=1, domino=True, domino_split="2d"),
        _zero3(QWEN3, 2, 2, 1, zero_stage=1, schedule="zb-h1", domino=True)]
# head_dim 4 here: at head_dim 8 with packed documents, cp 2's fp32 rounding grows past TOL in 6 steps at lr 0.5, Llama
# without QK-norm as much; in fp64 they agree to 4e-14 (tests/test_context_parallel.py)
CP = [cp_layout(replace(QWEN3, kv_channels=None), cp=2, dp=2, documents=True)]
EP = [(ep_config(QWEN3_MOE, ep=2, dp=2, tp=2, domino=True), MICRO_BATCH)]


def test_qwen_attention_and_router_compose_with_tp_domino_pipeline_cp_and_ep():
    """4 ranks: Qwen3 at tp 2 × dp 2 (Domino rows, SP) and tp 2 × pp 2 (ZB-H1), Qwen2 at tp 2 × dp 2 (Domino
    2-D), Qwen3 at cp 2 × dp 2 with packed documents, Qwen3-MoE at tp 2 × dp 2 × ep 2 with Domino. 6 SGD steps."""
    _covered(FOUR + CP + EP, run_ranks(_check_layouts, 4, FOUR, CP, EP, timeout=400))


@pytest.mark.quick
def test_qk_norm_and_qkv_bias_shapes():
    """QK-norm is one head_dim vector per layer for queries and one for keys; Qwen2's biases are q/k/v's alone."""
    names = dict(LanguageModel(QWEN3).named_parameters())
    assert names["layers.0.attention.q_norm.weight"].shape == (8,) and "layers.0.attention.qkv.bias" not in names
    names = dict(LanguageModel(QWEN2).named_parameters())
    assert "layers.0.attention.qkv.bias" in names and "layers.0.attention.proj.bias" not in names
    assert "layers.0.mlp.fc1.bias" not in names


@pytest.mark.quick
def test_qk_norm_without_heads_divisible_by_tp_is_refused_before_any_group():
    cfg = load_config(f"{REPO}/{TINY['llama']}", ["data.mock=true", "model.qk_norm=true", "parallel.tp=3"])
    with pytest.raises(ConfigError, match="num_attention_heads"):
        validate_config(cfg, world_size=3, check_paths=False)


@pytest.mark.parametrize("family, ranks, overrides", [
    ("qwen3", 2, ["parallel.tp=2", "parallel.domino=true"]),
    ("qwen3_moe", 2, ["parallel.dp=2", "parallel.ep=2"]),
])
def test_tiny_qwen3_configs_train(tmp_path, family, ranks, overrides):
    """configs/tiny/qwen3*.yaml through the Llama entry point on mock data, 2 ranks: the loss falls."""
    from tests.training_runs import metrics, train
    train(family, ranks, str(tmp_path), ["train.steps=12", "log.interval=1", "checkpoint.interval=0", *overrides])
    records = metrics(str(tmp_path))
    assert records[-1]["loss"] < records[0]["loss"] - 0.03, [r["loss"] for r in records]


@pytest.mark.quick
@pytest.mark.parametrize("name", ["8b", "30b-a3b", "235b-a22b"])
def test_qwen3_configs_pass_the_dry_run_at_their_gpu_count(name, monkeypatch):
    """Each shipped Qwen3 config at the GPU count its header states: valid, and it fits an H100 by the estimate."""
    import re
    import torch.distributed as dist
    from megatron_domino.training.dry_run import dry_run
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("the dry run started a group"))
    path = f"{REPO}/configs/qwen3/{name}.yaml"
    world = int(re.search(r"# GPUs: (\d+)", open(path).read()).group(1))
    text = dry_run(load_config(path), world, gpu="h100-80gb")
    assert "-> fits" in text, text[-2000:]


@pytest.mark.parametrize("name, world", [("8b", 8), pytest.param("30b-a3b", 64, marks=pytest.mark.sweep)])
def test_qwen3_configs_hold_the_planners_first_choice(name, world):
    """The parallel section of each config is what tools/plan.py ranks first on H100s at its GPU count (the
    235B's 256-GPU search takes minutes: checked by hand, its header says how)."""
    from megatron_domino.planner.hardware import get_gpu
    from megatron_domino.planner.search import first_valid, rank_layouts
    from tests.test_planner_cp import _filled
    cfg = load_config(f"{REPO}/configs/qwen3/{name}.yaml")
    best = first_valid(cfg, (e for e in rank_layouts(cfg, get_gpu("h100-80gb"), world // 8, 8) if e.fits), 1)
    assert best and best[0].layout.apply(cfg) == _filled(cfg, world), " ".join(best[0].layout.overrides())
