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


def test_rope_scaling_only_in_llama_3_1_and_yarn_in_the_tiny_deepseek():
    for path in CONFIG_FILES:
        cfg = load_config(path)
        yarn = os.path.basename(path) == "deepseek_v3.yaml"
        assert (cfg.model.rope_scaling_factor is not None) == ("llama3.1" in os.path.basename(path) or yarn), path
        assert (cfg.model.rope_scaling_type == "yarn") == yarn, path
    scaled = load_config(os.path.join(REPO, "configs", "llama", "llama3.1-8b.yaml")).model
    assert (scaled.rope_scaling_factor, scaled.rope_low_freq_factor, scaled.rope_high_freq_factor,
            scaled.rope_original_max_position, scaled.rope_base) == (8.0, 1.0, 4.0, 8192, 500000.0)
