"""``eval.path``: several validation sets, one loss per set; each equals a separate ``--eval-only`` run of that set
alone (and the training run's own split keeps its loss)."""
import pytest

from megatron_domino.config import ConfigError
from megatron_domino.config.eval_sets import parse_eval_sets
from megatron_domino.config.schema import Config
from megatron_domino.validation import validate_config
from tests.test_data_blended import make_prefix
from tests.training_runs import metrics, train


@pytest.mark.quick
def test_sets_are_prefixes_named_by_their_file_or_named_blends():
    sets = parse_eval_sets(["data/wiki_text_document", {"code": [0.5, "a", 0.5, "b"]}, {"one": "c"}])
    assert sets == [("wiki_text_document", ["data/wiki_text_document"]), ("code", [0.5, "a", 0.5, "b"]),
                    ("one", ["c"])]
    assert parse_eval_sets(None) == []


@pytest.mark.quick
@pytest.mark.parametrize("path, rule", [
    ([{"a": "x", "b": "y"}], "one-key mapping"),
    (["x", {"x": "y"}], "names two sets"),
    ([{"code": [0.5, "a", 0.5]}], "odd count"),
    ([3], "one-key mapping"),
])
def test_malformed_sets_are_refused_with_their_index(path, rule):
    with pytest.raises(ConfigError, match=rule):
        parse_eval_sets(path)


@pytest.mark.quick
def test_a_missing_set_is_refused_before_start(tmp_path):
    cfg = Config()
    cfg.data.mock, cfg.eval.path = True, [str(tmp_path / "absent")]
    with pytest.raises(ConfigError, match=r"eval.path\[0\]"):
        validate_config(cfg, world_size=1, check_paths=True)


@pytest.mark.slow
def test_each_set_has_its_loss_and_it_equals_an_eval_only_run_of_that_set(tmp_path):
    """The tiny GPT on two ranks (dp 2) with mock training data and two sets (a prefix, and a named blend of two);
    then ``--eval-only`` of the last checkpoint, one set at a time, on one process."""
    for name, low, high, seed in (("wiki", 0, 500, 1), ("code", 500, 1000, 2), ("math", 100, 900, 3)):
        make_prefix(tmp_path / name, low, high, seed, length=90)
    blend = f"{{mixed: [0.5, {tmp_path / 'code'}, 0.5, {tmp_path / 'math'}]}}"
    common = ["tokenizer.type=NullTokenizer", "train.eval_iters=1", "train.global_batch_size=4",
              "train.micro_batch_size=2"]
    run = str(tmp_path / "run")
    train("gpt", 2, run, [*common, "train.steps=2", "train.eval_interval=2", "parallel.dp=2",
                          f"eval.path=[{tmp_path / 'wiki'}, {blend}]"])
    records = metrics(run, "valid")
    by_set = {r.get("set"): r["loss"] for r in records if r["step"] == 2}
    assert sorted(by_set, key=str) == [None, "mixed", "wiki"]  # None: the training data's own split
    assert by_set["wiki"] != by_set["mixed"]
    for name, path in (("wiki", f"[{tmp_path / 'wiki'}]"), ("mixed", f"[{blend}]")):
        alone = str(tmp_path / f"alone-{name}")
        train("gpt", 1, alone, [*common, "--eval-only", f"checkpoint.load={run}/checkpoints", f"eval.path={path}"])
        (record,) = [r for r in metrics(alone, "valid") if r.get("set") == name]
        assert abs(record["loss"] - by_set[name]) <= 1e-6 * by_set[name], (name, record["loss"], by_set[name])
