"""Multi-head latent attention (MLA) and DeepSeek-V3: logits equal transformers' DeepseekV3ForCausalLM (fp32, sharp
weights, 6e-6 of the largest: tests/hf_sharp.py)
through tools/convert_checkpoint.py, with YaRN past the original context and without a query latent; a round trip
is bit-exact; parameters count as HF's; a tiny DeepSeek-V3 (MLA, YaRN, sigmoid routing with the expert bias, groups,
routed scaling, a dense first layer, a shared expert, the micro-batch and sequence-wise balance losses) trains like
one process (fp32, 1e-5) under TP with Domino and SP, recompute, the pipeline (1F1B, ZB-H1), CP with packed
documents, EP, and tp 2 × pp 2 × dp 2 × ep 2; bad configs are refused before any process group starts."""
import json
import os
import shutil
from dataclasses import replace

import pytest
import torch

from megatron_domino.config import ConfigError, ModelConfig, load_config
from megatron_domino.convert.convert import native_to_hf
from megatron_domino.models import LanguageModel
from megatron_domino.models.counters import count_parameters
from megatron_domino.validation import validate_config
from tests.harness import run_ranks
from tests.hf_sharp import assert_logits_close, sharpen
from tests.test_context_parallel import _layout as cp_layout
from tests.test_convert import _hf_tensors, _load_native, cli
from tests.test_expert_parallel import _config as ep_config, _run as ep_run
from tests.test_pipeline import MICRO_BATCH
from tests.test_zero3 import _check_layouts, _covered, _zero3
from tests.training_runs import REPO

transformers = pytest.importorskip("transformers")

YARN = dict(rope_scaling_type="yarn", rope_scaling_factor=4.0, rope_original_max_position=8, rope_yarn_mscale=1.0,
            rope_yarn_mscale_all_dim=1.0)
MLA = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                  vocab_size=200, make_vocab_size_divisible_by=8, position_embedding="rope", norm="rmsnorm",
                  activation="swiglu", bias=False, tie_embeddings=False, multi_latent_attention=True, kv_lora_rank=12,
                  q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, **YARN)
DEEPSEEK_V3 = replace(MLA, num_experts=8, moe_topk=2, moe_ffn_hidden_size=16, moe_router="sigmoid",
                      moe_shared_experts=1, moe_first_k_dense=1, moe_n_group=4, moe_topk_group=2,
                      moe_routed_scaling_factor=2.5, moe_router_bias_update_rate=1e-2, moe_aux_loss_coeff=0.01,
                      moe_seq_aux_loss_coeff=0.01)


def _hf_deepseek(q_lora_rank=16, yarn=True):
    """A tiny random DeepseekV3ForCausalLM: 3 layers (the first dense), 8 experts in 4 groups, 2 of which a token may
    use, a shared expert, its weights sharpened (tests/hf_sharp.py), the norms and expert bias too (HF starts them
    at 1 and 0)."""
    torch.manual_seed(5)
    rope = ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0} if yarn
            else {"rope_type": "default", "rope_theta": 10000.0})
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=12, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, v_head_dim=12,
        qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=32, rope_parameters=rope, bos_token_id=0, eos_token_id=0)
    return sharpen(transformers.DeepseekV3ForCausalLM(config).eval(), seed=16)


@pytest.mark.quick
@pytest.mark.parametrize("q_lora_rank, yarn", [(16, True), (None, False)], ids=["q-latent-yarn", "q-proj"])
def test_deepseek_v3_logits_match_transformers_and_round_trip_bit_exact(tmp_path, q_lora_rank, yarn):
    """At tp 2 (heads split): YaRN at twice its original context; without q_lora_rank the queries' own projection."""
    hf_model, hf_dir, native = _hf_deepseek(q_lora_rank, yarn), str(tmp_path / "hf"), str(tmp_path / "native")
    hf_model.save_pretrained(hf_dir, safe_serialization=True)
    assert cli.main(["hf-to-native", "--model", "deepseek_v3", "--input", hf_dir, "--output", native, "--tp", "2",
                     "--seq-length", "16", "--quiet"]) == 0
    cfg = load_config(os.path.join(native, "config.yaml"))
    assert cfg.model.is_mla and cfg.model.moe_first_k_dense == 1 and cfg.model.moe_n_group == 4
    model = _load_native(native, cfg.model)
    assert model.layers[1].mlp.router.expert_bias.abs().sum() > 0  # the correction bias landed
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        assert_logits_close(model.logits(None, {"tokens": tokens}), expected)
    back = str(tmp_path / "back")
    native_to_hf(native, back, quiet=True)
    original, exported = _hf_tensors(hf_dir), _hf_tensors(back)
    assert set(exported) == set(original)
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())
    with open(os.path.join(back, "config.json")) as f:
        out_cfg = json.load(f)
    reloaded = transformers.AutoConfig.from_pretrained(back)
    assert (reloaded.q_lora_rank, reloaded.n_group, out_cfg["rope_parameters"]["rope_type"]) == (
        q_lora_rank, 4, "yarn" if yarn else "default")
    shutil.rmtree(back)


@pytest.mark.quick
@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_mla_parameter_count_matches_transformers(q_lora_rank):
    from megatron_domino.convert.deepseek_v3 import deepseek_v3_model
    hf_model = _hf_deepseek(q_lora_rank)
    ours = deepseek_v3_model(hf_model.config.to_dict())
    assert count_parameters(ours) == sum(p.numel() for p in hf_model.parameters())
    trained = [p for p in LanguageModel(ours).parameters() if p.requires_grad]  # not the expert bias (HF: a buffer)
    assert count_parameters(ours) == sum(p.numel() for p in trained)


FOUR = [_zero3(MLA, 2, 1, 2, zero_stage=1, domino=True, sequence_parallel=True),  # Domino rows + SP
        _zero3(replace(MLA, recompute="selective", q_lora_rank=None), 2, 1, 2, zero_stage=1, domino=True,
               domino_split="2d"),
        _zero3(replace(MLA, recompute="full"), 2, 2, 1, zero_stage=1, schedule="zb-h1", domino=True),
        _zero3(MLA, 1, 2, 2, zero_stage=1)]  # 1F1B
CP = [cp_layout(MLA, cp=2, dp=2, documents=True), cp_layout(DEEPSEEK_V3, cp=2, dp=2)]
EP = [(ep_config(DEEPSEEK_V3, ep=2, dp=2, tp=2, domino=True, sequence_parallel=True), MICRO_BATCH),
      (ep_config(DEEPSEEK_V3, ep=2, dp=4), MICRO_BATCH)]


@pytest.mark.slow
def test_mla_trains_like_one_process_under_tp_domino_pipeline_cp_and_ep():
    """4 ranks, 6 SGD steps each: MLA at tp 2 × dp 2 (Domino rows with SP; Domino 2-D with selective recompute and
    no query latent), tp 2 × pp 2 (ZB-H1, full recompute), pp 2 × dp 2 (1F1B), cp 2 × dp 2 with packed documents;
    the tiny DeepSeek-V3 at cp 2 × dp 2, tp 2 × dp 2 × ep 2 (Domino, SP) and dp 4 × ep 2."""
    _covered(FOUR + CP + EP, run_ranks(_check_layouts, 4, FOUR, CP, EP, timeout=500))


EIGHT = [(ep_config(DEEPSEEK_V3, ep=2, dp=2, tp=2, pp=2, domino=True), MICRO_BATCH)]


def _check_eight(rank, world_size):
    return ep_run(world_size, EIGHT)


@pytest.mark.slow
def test_tiny_deepseek_v3_trains_like_one_process_on_tp2_pp2_dp2_ep2():
    _covered(EIGHT, run_ranks(_check_eight, 8, timeout=500))


@pytest.mark.quick
@pytest.mark.parametrize("overrides, key", [
    (["model.kv_lora_rank=32"], "model.kv_lora_rank"),  # a latent without MLA
    (["model.multi_latent_attention=true"], "model.kv_lora_rank"),  # MLA without its latent
    (["model.multi_latent_attention=true", "model.kv_lora_rank=16", "model.num_query_groups=2"],
     "model.num_query_groups"),
    (["model.multi_latent_attention=true", "model.kv_lora_rank=16", "model.qk_rope_head_dim=7"],
     "model.qk_rope_head_dim"),
    (["model.multi_latent_attention=true", "model.kv_lora_rank=16", "model.v_head_dim=512"], "model.v_head_dim"),
    (["model.multi_latent_attention=true", "model.kv_lora_rank=16", "parallel.tp=3"], "model.num_attention_heads"),
    (["model.rope_scaling_factor=4", "model.rope_scaling_type=ntk"], "model.rope_scaling_type"),
])
def test_bad_mla_configs_are_refused_before_any_group(overrides, key, monkeypatch):
    import torch.distributed as dist
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("a group was started"))
    cfg = load_config(f"{REPO}/configs/tiny/llama.yaml", ["data.mock=true", *overrides])
    tp = cfg.parallel.tp
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(cfg, world_size=tp * 2, check_paths=False)


@pytest.mark.quick
@pytest.mark.parametrize("name", ["deepseek/v3-671b", "deepseek/v2-lite"])
def test_deepseek_configs_pass_the_dry_run_at_their_gpu_count(name, monkeypatch):
    """Each shipped DeepSeek config at the GPU count its header states: valid, and it fits an H100 by the estimate."""
    import re
    import torch.distributed as dist
    from megatron_domino.training.dry_run import dry_run
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("the dry run started a group"))
    path = f"{REPO}/configs/{name}.yaml"
    world = int(re.search(r"# GPUs: (\d+)", open(path).read()).group(1))
    assert "-> fits" in dry_run(load_config(path), world, gpu="h100-80gb")


@pytest.mark.parametrize("name, world", [("deepseek/v2-lite", 16),  # V3's 1,024-GPU search: the sweep tier
                                         pytest.param("deepseek/v3-671b", 1024, marks=pytest.mark.sweep)])
def test_deepseek_configs_hold_the_planners_first_choice(name, world):
    """The parallel section of each config is what tools/plan.py ranks first on H100s at its GPU count."""
    from megatron_domino.planner.hardware import get_gpu
    from megatron_domino.planner.search import first_valid, rank_layouts
    from tests.test_planner_cp import _filled
    cfg = load_config(f"{REPO}/configs/{name}.yaml")
    best = first_valid(cfg, (e for e in rank_layouts(cfg, get_gpu("h100-80gb"), world // 8, 8) if e.fits), 1)
    assert best and best[0].layout.apply(cfg) == _filled(cfg, world), " ".join(best[0].layout.overrides())


@pytest.mark.slow
def test_tiny_deepseek_v3_config_trains(tmp_path):
    """configs/tiny/deepseek_v3.yaml through the Llama entry point on mock data at tp 2 × dp 2 × ep 2 with Domino:
    the loss falls, the expert bias moves, and the MTP module's loss is logged on its own and falls too."""
    from tests.training_runs import metrics, train
    train("deepseek_v3", 4, str(tmp_path), ["train.steps=12", "log.interval=1", "checkpoint.interval=0",
                                            "parallel.tp=2", "parallel.dp=2", "parallel.ep=2"])
    records = metrics(str(tmp_path))
    assert records[-1]["loss"] < records[0]["loss"] - 0.03, [r["loss"] for r in records]
    assert any(key.startswith("moe_expert_bias") for key in records[-1]), sorted(records[-1])
    assert records[-1]["mtp_loss"] < records[0]["mtp_loss"], [r["mtp_loss"] for r in records]


@pytest.mark.quick
def test_routing_only_deepseek_v3_has_is_refused_by_the_other_exports():
    from megatron_domino.convert.hf_config import model_type_of
    qwen3_moe = load_config(f"{REPO}/configs/tiny/qwen3_moe.yaml").model
    assert model_type_of(qwen3_moe) == "qwen3_moe"
    for change in ({"moe_router_bias_update_rate": 1e-3}, {"moe_n_group": 4, "moe_topk_group": 2},
                   {"moe_routed_scaling_factor": 2.5}):
        with pytest.raises(ValueError, match="DeepSeek-V3 only"):
            model_type_of(replace(qwen3_moe, **change))
    assert model_type_of(load_config(f"{REPO}/configs/tiny/deepseek_v3.yaml").model) == "deepseek_v3"
