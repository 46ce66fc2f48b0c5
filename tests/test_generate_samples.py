"""Samples during training (``eval.sample_prompts``): greedy continuations at every evaluation in metrics.jsonl,
TensorBoard and wandb text, on one process and at the quick start's layout TP2·PP2·DP2 (the stages run in turn;
sequence parallelism on top pads the growing sequence), each equal to tools/generate.py's greedy continuation
(KV cache, one process) from the checkpoint the run saved; the samples' config rules."""
import os
import subprocess
import sys

import pytest

from megatron_domino.config import load_config
from megatron_domino.config.errors import ConfigError
from megatron_domino.config.schema import TokenizerConfig
from megatron_domino.data import build_tokenizer
from megatron_domino.training.metrics import MetricsWriter
from megatron_domino.validation import validate_config
from tests.tools import load_tool
from tests.training_runs import REPO, TINY, environment, metrics, train

PROMPTS = ["Once upon a time", "The old man said"]


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The quick start's corpus and SentencePiece tokenizer, made in a temporary folder."""
    out = tmp_path_factory.mktemp("quickstart")
    assert load_tool("prepare_quickstart_data").main(["--output-dir", str(out)]) == 0
    return str(out)


def _overrides(data: str, steps: int, tokens: int) -> list[str]:
    """A short run on the quick start's data, evaluating twice; a wide init, so that a few steps in the greedy
    continuations vary (the default init writes one token again and again, which any bug would repeat too)."""
    return ["model.init_std=0.3", f"data.path=[{data}/corpus_text_document]", "data.mock=false",
            "tokenizer.type=SentencePieceTokenizer", f"tokenizer.model={data}/tokenizer.model", f"train.steps={steps}",
            f"train.eval_interval={steps // 2}", "train.eval_iters=1", "optimizer.warmup_steps=1",
            f"eval.sample_prompts=[{', '.join(PROMPTS)}]", f"eval.sample_tokens={tokens}"]


def _greedy_text(checkpoints: str, data: str, prompt: str, tokens: int) -> str:
    """tools/generate.py's greedy continuation of ``prompt`` (one process), as the samples show it."""
    result = subprocess.run([sys.executable, os.path.join(REPO, "tools", "generate.py"), "--load", checkpoints,
                             "--prompt", prompt, "--max-new-tokens", str(tokens), "--print-ids",
                             "parallel.backend=gloo"], cwd=REPO, env=environment(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    ids = [int(t) for t in result.stdout.split("ids:")[1].split()]
    tokenizer = build_tokenizer(TokenizerConfig("SentencePieceTokenizer", model=f"{data}/tokenizer.model"))
    return tokenizer.decode(ids[:ids.index(tokenizer.eod)] if tokenizer.eod in ids else ids)


def _check_samples(run_dir: str, data: str, steps: int, tokens: int) -> None:
    samples = metrics(run_dir, "sample")
    assert [(r["step"], r["prompt"]) for r in samples] == [(s, p) for s in (steps // 2, steps) for p in PROMPTS]
    last = {r["prompt"]: r["text"] for r in samples if r["step"] == steps}
    assert all(len(set(text)) >= 3 for text in last.values()), last
    checkpoints = os.path.join(run_dir, "checkpoints")
    assert last == {prompt: _greedy_text(checkpoints, data, prompt, tokens) for prompt in PROMPTS}


@pytest.mark.slow
def test_samples_in_metrics_and_tensorboard_equal_the_generate_tool(quickstart, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir = str(tmp_path / "run")
    train("gpt", 1, run_dir, _overrides(quickstart, 6, 10) + ["log.tensorboard=true"])
    _check_samples(run_dir, quickstart, 6, 10)
    events = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert {"samples/0/text_summary", "samples/1/text_summary"} <= set(events.Tags()["tensors"])


@pytest.mark.slow
def test_samples_at_the_quick_start_layout_run_the_stages_in_turn(quickstart, tmp_path):
    run_dir = str(tmp_path / "run")
    train("gpt", 8, run_dir, _overrides(quickstart, 4, 6) + ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2",
                                                             "parallel.domino=true", "parallel.sequence_parallel=true"])
    _check_samples(run_dir, quickstart, 4, 6)


def test_wandb_gets_the_samples_as_a_table(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = MetricsWriter(str(tmp_path), True, False, ("tests", "offline", {}))
    writer.write_samples(3, [("Once upon a time", " there was a cat")])
    writer.close()
    tables = [os.path.join(root, name) for root, _, names in os.walk(tmp_path) for name in names
              if name.startswith("samples") and name.endswith(".table.json")]
    assert tables and "there was a cat" in open(tables[0], encoding="utf-8").read()


@pytest.mark.parametrize("overrides, message", [
    (["eval.sample_tokens=0"], "eval.sample_tokens = 0: must be positive"),
    (["tokenizer.type=NullTokenizer"], "eval.sample_prompts = .*NullTokenizer reads none"),
    (["eval.sample_tokens=64"], "eval.sample_tokens = 64: leaves no room for the prompt"),
    (["eval.sample_prompts=[' ']"], r"eval.sample_prompts\[0\] = ' ': is empty"),
])
def test_sample_settings_are_checked(overrides, message):
    cfg = load_config(os.path.join(REPO, TINY["gpt"]), ["data.mock=true", "eval.sample_prompts=[Once]", *overrides])
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, world_size=1, check_paths=False)


def test_samples_under_context_parallelism_are_skipped_with_a_warning():
    cfg = load_config(os.path.join(REPO, TINY["llama"]), ["data.mock=true", "eval.sample_prompts=[Once]",
                                                          "tokenizer.type=SentencePieceTokenizer", "parallel.cp=2"])
    assert any("no samples are drawn under parallel.cp > 1" in w
               for w in validate_config(cfg, world_size=2, check_paths=False))
