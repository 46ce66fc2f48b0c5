"""Config loading (includes, overrides, types, round trip), validation rules and the shipped YAML files."""
from __future__ import annotations

import dataclasses
import glob
import os

import pytest

from megatron_domino.config import (
    Config, ConfigError, DataBlend, ModelConfig, config_from_dict, config_to_dict, load_config, parse_data_path,
    save_config,
)
from megatron_domino.domino.plan import ROW_SPLIT_WARNING
from megatron_domino.validation import validate_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True))


def write(path, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


# ---------------------------------------------------------------- includes

def test_nested_relative_includes_merge_in_order(tmp_path):
    write(tmp_path / "shared" / "arch.yaml", "model:\n  norm: rmsnorm\n  hidden_size: 32\n  num_layers: 3\n")
    write(tmp_path / "shared" / "base.yaml",
          "include: arch.yaml\nmodel:\n  hidden_size: 48\ndata:\n  path: [a, b]\n")
    write(tmp_path / "other.yaml", "model:\n  hidden_size: 96\n  activation: swiglu\ndata:\n  path: [c]\n")
    top = write(tmp_path / "runs" / "exp.yaml",
                "include: [../shared/base.yaml, ../other.yaml]\nmodel:\n  num_layers: 5\n")
    cfg = load_config(top)
    assert cfg.model.norm == "rmsnorm"          # from the innermost include
    assert cfg.model.hidden_size == 96          # later include beats earlier
    assert cfg.model.activation == "swiglu"
    assert cfg.model.num_layers == 5            # the file's own keys beat its includes
    assert cfg.data.path == ["c"]               # lists are replaced, not concatenated
    assert cfg.model.num_attention_heads == ModelConfig().num_attention_heads  # untouched keys keep defaults


def test_include_cycle_is_reported(tmp_path):
    write(tmp_path / "a.yaml", "include: sub/b.yaml\n")
    write(tmp_path / "sub" / "b.yaml", "include: ../a.yaml\n")
    with pytest.raises(ConfigError, match="include cycle") as err:
        load_config(str(tmp_path / "a.yaml"))
    assert err.value.keys == ["include"]


def test_missing_include_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(write(tmp_path / "a.yaml", "include: nowhere.yaml\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path / "b.yaml", "model: [unclosed\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path / "c.yaml", "- a\n- b\n"))


# ---------------------------------------------------------------- overrides and types

def test_overrides_parse_and_convert_types():
    cfg = load_config(None, ["parallel.tp=2", "train.steps=20", "data.path=[a,b]", "optimizer.lr=3e-4",
                             "optimizer.min_lr=0", "parallel.dp=null", "parallel.domino=true",
                             "train.tokens=1e9", "parallel.pipeline_layout=[1, 3]", "data.split=100",
                             "checkpoint.load=on"])
    assert cfg.parallel.tp == 2 and type(cfg.parallel.tp) is int
    assert cfg.optimizer.lr == 3e-4                              # 3e-4 is a float (YAML 1.1 would say string)
    assert cfg.optimizer.min_lr == 0.0 and type(cfg.optimizer.min_lr) is float  # float accepts an int
    assert cfg.train.tokens == 10**9 and type(cfg.train.tokens) is int           # integral float -> int
    assert cfg.parallel.dp is None and cfg.parallel.domino is True
    assert cfg.data.path == ["a", "b"] and cfg.parallel.pipeline_layout == [1, 3]
    assert cfg.data.split == "100" and cfg.checkpoint.load == "on"  # 'on' is no boolean here


def test_override_list_forms_for_data_path():
    assert load_config(None, ["data.path=corpus_text_document"]).data.path == ["corpus_text_document"]
    assert load_config(None, ["data.path=[0.3,A,0.7,B]"]).data.path == ["0.3", "A", "0.7", "B"]


@pytest.mark.parametrize("override, key", [
    ("parallel.tp=2.5", "parallel.tp"),
    ("parallel.tp=two", "parallel.tp"),
    ("parallel.domino=yes", "parallel.domino"),
    ("parallel.domino=1", "parallel.domino"),
    ("optimizer.lr=fast", "optimizer.lr"),
    ("model.norm=true", "model.norm"),
    ("parallel.tp=null", "parallel.tp"),
    ("data.path={a: 1}", "data.path"),
    ("parallel.pipeline_layout=[1, x]", "parallel.pipeline_layout[1]"),
])
def test_wrong_types_are_rejected(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert key in err.value.keys and "Fix: " in str(err.value)


@pytest.mark.parametrize("override, key, hint", [
    ("parallel.tpp=2", "parallel.tpp", "did you mean 'tp'?"),
    ("paralel.tp=2", "paralel", "did you mean 'parallel'?"),
    ("train.tp=2", "train.tp", "did you mean 'parallel.tp'?"),
    ("optimizer.learning_rate=1", "optimizer.learning_rate", "valid names are"),
])
def test_unknown_keys_suggest_a_name(override, key, hint):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.keys == [key] and hint in str(err.value)


def test_unknown_key_in_yaml_file(tmp_path):
    path = write(tmp_path / "x.yaml", "model:\n  num_layer: 4\n")
    with pytest.raises(ConfigError, match=r"model.num_layer = 4: .*did you mean 'num_layers'\?"):
        load_config(path)


@pytest.mark.parametrize("override", ["parallel.tp", "tp=2", "a.b.c=1", "parallel.tp=[1"])
def test_malformed_overrides(override):
    with pytest.raises(ConfigError, match="Fix: "):
        load_config(None, [override])


def test_override_beats_file(tmp_path):
    path = write(tmp_path / "x.yaml", "parallel:\n  tp: 4\n")
    assert load_config(path, ["parallel.tp=2"]).parallel.tp == 2


def test_config_from_dict_checks_like_the_loader():
    assert config_from_dict({"model": {"num_layers": 3}, "log": None}).model.num_layers == 3
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": {"num_layers": "3", "hiden_size": 8}, "train": 5})
    assert err.value.keys == ["model.num_layers", "model.hiden_size", "train"]  # all problems at once


# ---------------------------------------------------------------- round trip

def test_save_config_round_trips_exactly(tmp_path):
    cfg = load_config(os.path.join(REPO, "configs", "tiny", "llama.yaml"),
                      ["data.split='1e3'", "data.cache_dir=yes", "parallel.timeout_s=.inf", "optimizer.eps=1e-12",
                       "parallel.pipeline_layout=[1,3]", "parallel.pp=2", "train.tokens=123456789012345"])
    target = str(tmp_path / "out" / "config.yaml")
    save_config(cfg, target)
    again = load_config(target)
    assert again == cfg
    assert again.data.split == "1e3" and again.data.cache_dir == "yes"   # number-like strings stay strings
    assert os.listdir(tmp_path / "out") == ["config.yaml"]               # no temporary file left behind
    save_config(again, target)                                          # overwrite in place
    assert load_config(target) == cfg


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: os.path.relpath(p, REPO))
def test_every_shipped_config_loads_validates_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    p = cfg.parallel
    assert validate_config(cfg, world_size=p.tp * p.cp * p.pp * (p.dp or 1), check_paths=False) == []
    save_config(cfg, str(tmp_path / "c.yaml"))
    assert load_config(str(tmp_path / "c.yaml")) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


# ---------------------------------------------------------------- validation: a table of invalid configs

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
    (["optimizer.zero_stage=3"], 1, "optimizer.zero_stage"),
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


def test_data_path_forms_follow_megatron():
    assert parse_data_path(["a"]) == DataBlend(("a",), None)
    assert parse_data_path("a") == DataBlend(("a",), None)  # one prefix without brackets, as the loader allows
    assert parse_data_path(["a", "b"]) == DataBlend(("a", "b"), None)  # unweighted: the builder weighs by size
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == DataBlend(("a", "b"), (0.3, 0.7))
    assert parse_data_path([2, "a", 1, "b"]) == DataBlend(("a", "b"), (2.0, 1.0))  # numbers as YAML gives them
    assert load_config(None, ["data.path=[0.3,a,0.7,b]"]).data.path == ["0.3", "a", "0.7", "b"]


@pytest.mark.parametrize("path, keys, rule", [
    ([], ["data.path"], "is empty"),
    (["0.3", "a", "b"], ["data.path"], "odd count"),
    (["0.3", "a", "x", "b"], ["data.path[2]"], "must be a positive number"),
    (["0.3", "a", "-1", "b"], ["data.path[2]"], "must be a positive number"),
    (["0", "a", "nan", "b", "inf", "c"], ["data.path[0]", "data.path[2]", "data.path[4]"], "positive number"),
    (["0.3", "a", "0.7", "0.5"], ["data.path[3]"], "a number where a prefix belongs"),
    (["a", "0.5", "b"], ["data.path[1]"], "a number in a list of prefixes without weights"),
])
def test_data_path_errors_name_the_entry(path, keys, rule):
    with pytest.raises(ConfigError, match=rule) as err:
        parse_data_path(path)
    assert err.value.keys == keys and "Fix:" in str(err.value)
    with pytest.raises(ConfigError) as err:  # validation reports the same, before any process starts
        validate_config(Config(data=dataclasses.replace(Config().data, path=path)), check_paths=False)
    assert err.value.keys == keys


# ---------------------------------------------------------------- shipped configs

def test_tiny_configs_allow_the_documented_layouts():
    for name, tps in (("gpt", (1, 2, 4)), ("llama", (1, 2, 4))):
        path = os.path.join(REPO, "configs", "tiny", f"{name}.yaml")
        for tp in tps:
            for pp in (1, 2, 4):
                cfg = load_config(path, [f"parallel.tp={tp}", f"parallel.pp={pp}"])
                assert validate_config(cfg, world_size=tp * pp, check_paths=False) == []
    with pytest.raises(ConfigError, match="model.num_query_groups"):  # 2 KV groups cannot split over 4 ranks
        validate_config(load_config(os.path.join(REPO, "configs", "tiny", "llama.yaml"),
                                    ["parallel.tp=4", "model.num_query_groups=2"]), world_size=4, check_paths=False)


def test_tiny_llama_is_a_gqa_llama():
    m = load_config(os.path.join(REPO, "configs", "tiny", "llama.yaml")).model
    assert (m.position_embedding, m.norm, m.activation, m.bias, m.tie_embeddings) == ("rope", "rmsnorm", "swiglu",
                                                                                     False, False)
    assert m.query_groups == 4 < m.num_attention_heads


def test_rope_scaling_only_in_llama_3_1():
    for path in CONFIG_FILES:
        cfg = load_config(path)
        assert (cfg.model.rope_scaling_factor is not None) == ("llama3.1" in os.path.basename(path)), path
    scaled = load_config(os.path.join(REPO, "configs", "llama", "llama3.1-8b.yaml")).model
    assert (scaled.rope_scaling_factor, scaled.rope_low_freq_factor, scaled.rope_high_freq_factor,
            scaled.rope_original_max_position, scaled.rope_base) == (8.0, 1.0, 4.0, 8192, 500000.0)


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
