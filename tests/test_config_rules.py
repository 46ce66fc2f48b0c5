"""The validation rules: every bad setting named with a fix, all problems together, warnings for surprises,
and each rule's one home shared by the validator and the part that owns it."""
from __future__ import annotations

import dataclasses
import os

import pytest

from megatron_domino.config import Config, ConfigError, ModelConfig, load_config
from megatron_domino.domino.plan import ROW_SPLIT_WARNING
from megatron_domino.validation import validate_config
from tests.test_config import write

BASE = ["data.mock=true"]  # schema defaults plus mock data: a valid config (checked below)

INVALID = [  # (overrides, world size, offending key)
    (["model.num_layers=0"], 1, "model.num_layers"),
    (["train.exit_interval=-1"], 1, "train.exit_interval"),
    (["model.hidden_size=-64"], 1, "model.hidden_size"),
    (["model.num_attention_heads=0"], 1, "model.num_attention_heads"),
    (["model.vocab_size=0"], 1, "model.vocab_size"),
    (["model.seq_length=0"], 1, "model.seq_length"),
    (["model.ffn_hidden_size=0"], 1, "model.ffn_hidden_size"),
    (["model.norm_eps=0"], 1, "model.norm_eps"),
    (["model.num_query_groups=3"], 1, "model.num_query_groups"),          # 4 heads % 3 groups
    (["model.hidden_size=66"], 1, "model.hidden_size"),                    # 66 % 4 heads, no kv_channels
    (["parallel.tp=3"], 3, "model.num_attention_heads"),                   # 4 heads % tp 3
    (["parallel.tp=2", "model.num_query_groups=1"], 2, "model.num_query_groups"),
    (["parallel.tp=2", "model.ffn_hidden_size=129"], 2, "model.ffn_hidden_size"),
    (["optimizer.offload=gpu"], 1, "optimizer.offload"),
    (["optimizer.offload=cpu", "optimizer.zero_stage=0"], 1, "optimizer.offload"),
    (["optimizer.offload=cpu", "optimizer.offload_fraction=1.5"], 1, "optimizer.offload_fraction"),
    (["parallel.tp=4", "model.hidden_size=66", "model.kv_channels=16"], 4, "model.hidden_size"),
    (["parallel.tp=2"], 3, "parallel.dp"),                                 # world 3 not divisible by tp*pp
    (["parallel.dp=2"], 4, "parallel.dp"),                                 # 1*1*2 != 4
    (["parallel.tp=0"], 1, "parallel.tp"),
    (["parallel.pp=-1"], 1, "parallel.pp"),
    (["parallel.pp=2", "model.num_layers=3"], 2, "model.num_layers"),      # uniform partition
    (["parallel.pp=2", "parallel.pipeline_layout=[1,1,1]", "model.num_layers=3"], 2, "parallel.pipeline_layout"),
    (["parallel.pp=2", "parallel.pipeline_layout=[0,2]"], 2, "parallel.pipeline_layout"),
    (["parallel.pp=2", "parallel.pipeline_layout=[1,2]"], 2, "parallel.pipeline_layout"),  # sums to 3, not 2
    (["parallel.virtual_pp=2"], 1, "parallel.virtual_pp"),                 # needs pp > 1
    (["parallel.pp=2", "parallel.virtual_pp=2", "model.num_layers=4", "train.global_batch_size=6"], 2,
     "parallel.virtual_pp"),                                               # 3 micro-batches, not a multiple of pp
    (["parallel.pp=2", "parallel.virtual_pp=2", "model.num_layers=4", "parallel.pipeline_schedule=zb-h1"], 2,
     "parallel.pipeline_schedule"),                                        # one chunk per rank
    (["parallel.pp=2", "parallel.pipeline_schedule=interleaved"], 2, "parallel.pipeline_schedule"),
    (["parallel.pipeline_schedule=zb_h1"], 1, "parallel.pipeline_schedule"),
    (["train.global_batch_size=7"], 1, "train.global_batch_size"),
    (["parallel.dp=3"], 3, "train.global_batch_size"),                     # 8 % (2 * 3)
    (["train.micro_batch_size=0"], 1, "train.micro_batch_size"),
    (["train.steps=0"], 1, "train.steps"),
    (["parallel.domino=true", "parallel.domino_chunks=0"], 1, "parallel.domino_chunks"),
    (["parallel.domino=true", "parallel.domino_split=rows"], 1, "parallel.domino_split"),
    (["parallel.domino=true", "parallel.domino_overlap=both"], 1, "parallel.domino_overlap"),
    (["parallel.sequence_parallel=true", "parallel.tp=2", "model.seq_length=63"], 2, "model.seq_length"),
    (["model.seq_length=128", "model.max_position_embeddings=64"], 1, "model.seq_length"),
    (["train.fp16=true", "train.bf16=true"], 1, "train.fp16"),
    (["model.norm=batchnorm"], 1, "model.norm"),
    (["model.activation=relu"], 1, "model.activation"),
    (["model.position_embedding=alibi"], 1, "model.position_embedding"),
    (["model.recompute=partial"], 1, "model.recompute"),
    (["model.attention_backend=cudnn"], 1, "model.attention_backend"),
    (["model.position_embedding=rope", "model.rope_scaling_factor=8", "model.rope_high_freq_factor=0.5"], 1,
     "model.rope_high_freq_factor"),
    (["optimizer.name=adam"], 1, "optimizer.name"),
    (["optimizer.lr_schedule=exponential"], 1, "optimizer.lr_schedule"),
    (["tokenizer.type=BPE"], 1, "tokenizer.type"),
    (["tokenizer.type=GPT2BPETokenizer"], 1, "tokenizer.vocab_file"),
    (["parallel.order=tp-pp"], 1, "parallel.order"),
    (["parallel.order=tp-dp-dp"], 1, "parallel.order"),
    (["parallel.backend=mpi"], 1, "parallel.backend"),
    (["parallel.pipeline_partition=balanced"], 1, "parallel.pipeline_partition"),
    (["optimizer.zero_stage=4"], 1, "optimizer.zero_stage"),
    (["optimizer.zero_stage=3", "optimizer.prefetch_depth=-1"], 1, "optimizer.prefetch_depth"),
    (["optimizer.zero_stage=3", "optimizer.prefetch_depth=9"], 1, "optimizer.prefetch_depth"),
    (["model.hidden_dropout=1.0"], 1, "model.hidden_dropout"),
    (["model.attention_dropout=-0.1"], 1, "model.attention_dropout"),
    (["optimizer.lr=1e-4", "optimizer.min_lr=1e-3"], 1, "optimizer.min_lr"),
    (["optimizer.min_lr=-1e-5"], 1, "optimizer.min_lr"),
    (["optimizer.lr=0"], 1, "optimizer.lr"),
    (["optimizer.beta2=1.0"], 1, "optimizer.beta2"),
    (["optimizer.warmup_steps=50"], 1, "optimizer.warmup_steps"),          # > train.steps, decay_steps unset
    (["data.mock=false"], 1, "data.path"),                                 # no data at all
    (["data.path=[0.3,a,b]"], 1, "data.path"),                             # weights and prefixes must alternate
    (["data.path=[0.3,a,-0.7,b]"], 1, "data.path[2]"),
    (["data.split=90,10,0,0"], 1, "data.split"),
    (["checkpoint.load=auto"], 1, "checkpoint.load"),                      # needs checkpoint.dir
    (["checkpoint.interval=10"], 1, "checkpoint.interval"),                # needs checkpoint.dir
    (["log.interval=0"], 1, "log.interval"),
    (["parallel.timeout_s=0"], 1, "parallel.timeout_s"),
    (["parallel.timeout_s=60", "parallel.collective_timeout_s=90"], 1, "parallel.collective_timeout_s"),  # < 2 * 60
    (["parallel.collective_timeout_s=-1"], 1, "parallel.collective_timeout_s"),
    (["data.index_build_timeout_s=0"], 1, "data.index_build_timeout_s"),
    (["checkpoint.save_timeout_s=-5"], 1, "checkpoint.save_timeout_s"),
    (["checkpoint.load_timeout_s=0"], 1, "checkpoint.load_timeout_s"),
    (["train.on_bad_step=ignore"], 1, "train.on_bad_step"),
    (["train.on_bad_step=skip", "train.spike_factor=0.5"], 1, "train.spike_factor"),
    (["train.spike_factor=3"], 1, "train.spike_factor"),                  # needs train.on_bad_step
    (["train.on_bad_step=stop", "train.spike_window=0"], 1, "train.spike_window"),
    (["log.wandb_project=p", "log.wandb_mode=offlin"], 1, "log.wandb_mode"),
    (["log.straggler_interval=-1"], 1, "log.straggler_interval"),
    (["log.profile_steps=[5,2]"], 1, "log.profile_steps"),
    (["log.profile_steps=[3]"], 1, "log.profile_steps"),
    (["model.num_experts=4", "model.moe_topk=5"], 1, "model.moe_topk"),    # more experts per token than exist
    (["model.num_experts=4", "model.moe_topk=0"], 1, "model.moe_topk"),
    (["model.num_experts=4", "model.moe_capacity_factor=0"], 1, "model.moe_capacity_factor"),
    (["model.num_experts=4", "model.moe_layer_freq=[1,0,1]"], 1, "model.moe_layer_freq"),  # 2 layers
    (["model.num_experts=4", "model.moe_layer_freq=0"], 1, "model.moe_layer_freq"),
    (["model.num_experts=4", "model.moe_router=softmx"], 1, "model.moe_router"),
    (["model.num_experts=4", "parallel.ep=3"], 3, "parallel.ep"),         # divides dp 3, not 4 experts
    (["model.num_experts=6", "parallel.ep=3"], 2, "parallel.ep"),         # divides 6 experts, not dp 2
    (["model.num_experts=4", "parallel.ep=4", "parallel.dp=2"], 2, "parallel.ep"),  # more expert ranks than dp
    (["parallel.ep=2"], 2, "parallel.ep"),                                 # a dense model has no experts
    (["parallel.tp=2", "parallel.expert_tp=1"], 2, "parallel.expert_tp"),  # nor experts to keep whole
    (["model.num_experts=4", "log.sync_debug=true"], 1, "log.sync_debug"),  # routing reads counts on the host
    (["train.fp16=true", "log.sync_debug=true"], 1, "log.sync_debug"),     # the loss scaler reads its flag
    (["parallel.pp=2", "parallel.variable_seq_lengths=true", "log.sync_debug=true"], 2,
     "log.sync_debug"),  # a pipeline receive reads its shape
    (["data.mock_document_tokens=0"], 1, "data.mock_document_tokens"),
    (["parallel.pp=2", "model.num_layers=4", "parallel.pipeline_layout=[1,3]",
      "parallel.pipeline_partition=parameters"], 2, "parallel.pipeline_layout"),  # the layout and the balancer both
]


def test_base_of_the_table_is_valid():
    assert validate_config(load_config(None, BASE), world_size=1, check_paths=False) == []


def test_table_has_enough_cases():
    assert len(INVALID) >= 35


@pytest.mark.parametrize("overrides, world_size, key", INVALID, ids=[" ".join(o) for o, _, _ in INVALID])
def test_invalid_config_names_the_key_and_a_fix(overrides, world_size, key):
    cfg = load_config(None, BASE + overrides)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, world_size=world_size, check_paths=False)
    assert key in err.value.keys
    line = next(line for line in str(err.value).splitlines() if line.startswith(f"{key} = "))
    assert ": " in line and ". Fix: " in line and not line.endswith("Fix: ")


def test_all_problems_are_reported_together():
    cfg = load_config(None, BASE + ["model.norm=batch", "optimizer.zero_stage=5", "train.global_batch_size=7"])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, check_paths=False)
    assert {"model.norm", "optimizer.zero_stage", "train.global_batch_size"} <= set(err.value.keys)
    assert len(str(err.value).splitlines()) == len(err.value.keys)


def test_enum_error_suggests_the_close_name():
    with pytest.raises(ConfigError, match="did you mean 'row'"):
        validate_config(load_config(None, BASE + ["parallel.domino_split=rows"]), check_paths=False)


def test_configs_built_in_code_get_type_checks():
    cfg = Config(model=ModelConfig(num_layers="4"))
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, check_paths=False)
    assert err.value.keys == ["model.num_layers"]


def test_world_size_infers_data_parallel_for_batch_checks():
    cfg = load_config(None, BASE + ["parallel.tp=2", "train.global_batch_size=8"])
    validate_config(cfg, world_size=8, check_paths=False)  # dp 4: 8 = 2 * 4
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        validate_config(cfg, world_size=16, check_paths=False)  # dp 8: 8 % 16


# ---------------------------------------------------------------- warnings

def test_row_split_with_micro_batch_one_warns_not_fails():
    cfg = load_config(None, BASE + ["parallel.domino=true", "parallel.domino_split=row", "train.micro_batch_size=1"])
    assert validate_config(cfg, check_paths=False) == [ROW_SPLIT_WARNING]
    assert ROW_SPLIT_WARNING == ("parallel.domino_split=row needs train.micro_batch_size >= 2; "
                                 "micro batch 1 runs the column split instead")
    column = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, domino_split="column"))
    assert validate_config(column, check_paths=False) == []


def test_flash_with_fp32_weights_warns_without_a_device_and_fails_on_cuda():
    """CUDA's flash kernel takes 16-bit inputs only: pinned to it, fp32 runs raise 'No available kernel' at the
    first step on a GPU. Validation knows the device once the backend is chosen (the entry points pass it)."""
    cfg = load_config(None, BASE + ["model.attention_backend=flash", "train.bf16=false"])
    assert any("flash" in w for w in validate_config(cfg, check_paths=False))
    assert validate_config(cfg, check_paths=False, device_type="cpu") == []
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, check_paths=False, device_type="cuda")
    assert err.value.keys == ["model.attention_backend"] and "train.bf16=true" in str(err.value)
    bf16 = load_config(None, BASE + ["model.attention_backend=flash", "train.bf16=true"])
    assert validate_config(bf16, check_paths=False, device_type="cuda") == []


def test_sequence_parallel_without_tp_warns():
    warnings = validate_config(load_config(None, BASE + ["parallel.sequence_parallel=true"]), check_paths=False)
    assert len(warnings) == 1 and "sequence_parallel" in warnings[0]


def test_f_and_b_turns_without_their_units_warn():
    """The turns need dualpipev's F&B units, and Domino's waits at tp > 1 or the experts' exchanges at ep > 1;
    elsewhere the setting is said to do nothing."""
    v_tp2 = ["model.num_layers=4", "parallel.pp=2", "parallel.tp=2", "parallel.pipeline_schedule=dualpipev",
             "train.micro_batch_size=2", "train.global_batch_size=8", "parallel.overlap_f_and_b=true"]
    assert validate_config(load_config(None, BASE + v_tp2 + ["parallel.domino=true"]), check_paths=False,
                           world_size=4) == []
    experts = ["parallel.tp=1", "parallel.dp=2", "model.num_experts=4", "parallel.ep=2", "train.global_batch_size=16"]
    assert validate_config(load_config(None, BASE + v_tp2 + experts), check_paths=False, world_size=4) == []
    for unused in (["parallel.domino=false"], ["parallel.domino=true", "parallel.pipeline_schedule=zb-v"],
                   ["parallel.tp=1", "parallel.dp=2", "parallel.pipeline_schedule=zb-v", "model.num_experts=4",
                    "parallel.ep=2"]):
        warnings = validate_config(load_config(None, BASE + v_tp2 + unused), check_paths=False, world_size=4)
        assert len(warnings) == 1 and "parallel.overlap_f_and_b=true has no effect" in warnings[0], unused


# ---------------------------------------------------------------- paths

def test_paths_are_checked_only_when_asked(tmp_path):
    prefix = str(tmp_path / "corpus")
    write(prefix + ".bin", "")
    overrides = [f"data.path=[0.7,{prefix},0.3,{prefix}]", "tokenizer.type=SentencePieceTokenizer",
                 f"tokenizer.model={tmp_path / 'sp.model'}", f"checkpoint.load={tmp_path / 'ckpt'}"]
    cfg = load_config(None, overrides)
    validate_config(cfg, check_paths=False)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert err.value.keys == ["data.path", "data.path", "tokenizer.model", "checkpoint.load"]
    assert "corpus.idx not found" in str(err.value)
    write(prefix + ".idx", "")
    write(str(tmp_path / "sp.model"), "")
    os.makedirs(tmp_path / "ckpt")
    assert validate_config(cfg) == []


def _owner_refusal(cfg, world_size):
    """What the part that owns the rule raises when it is built from ``cfg`` (the rank grid, Domino's plan,
    the layer partition, the schedule), or None when every part accepts it."""
    from megatron_domino.domino.plan import DominoPlan
    from megatron_domino.parallel import Topology
    from megatron_domino.pipeline.schedules import schedule_for
    from megatron_domino.pipeline.stages import layer_partition
    try:
        topology = Topology.from_config(cfg.parallel, world_size)
        DominoPlan.from_config(cfg.parallel)
        layer_partition(cfg)
        schedule_for(cfg.parallel, cfg.train.num_microbatches(topology.dp))
    except ConfigError as error:
        return error
    return None


@pytest.mark.parametrize("overrides, world_size", [
    (["parallel.tp=2"], 3), (["parallel.dp=2"], 4), (["parallel.order=tp-pp"], 1), (["parallel.ep=3"], 4),
    (["parallel.tp=2", "parallel.expert_tp=3"], 2), (["parallel.domino_chunks=0"], 1),
    (["parallel.domino_overlap=both"], 1), (["parallel.pp=2", "model.num_layers=3"], 2),
    (["parallel.pp=2", "parallel.pipeline_layout=[0,2]"], 2),
    (["parallel.pp=2", "model.num_layers=4", "parallel.pipeline_layout=[1,3]",
      "parallel.pipeline_partition=parameters"], 2),
    (["parallel.pp=2", "parallel.virtual_pp=2", "model.num_layers=4", "train.global_batch_size=6"], 2),
    (["parallel.pp=2", "parallel.virtual_pp=2", "model.num_layers=4", "parallel.pipeline_schedule=zb-h1"], 2),
    (["parallel.pp=2", "parallel.pipeline_schedule=interleaved"], 2),
])
def test_each_rule_has_one_home_that_the_validator_and_the_owner_share(overrides, world_size):
    """validate_config reports exactly what the owning part refuses when it is built: one function each."""
    cfg = load_config(None, BASE + overrides)
    owned = _owner_refusal(cfg, world_size)
    assert owned is not None, overrides
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, world_size=world_size, check_paths=False)
    assert all(problem in err.value.problems for problem in owned.problems), (owned.problems, err.value.problems)
