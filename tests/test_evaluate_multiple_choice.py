"""tools/evaluate.py: multiple-choice items scored by log-likelihood equal transformers' scores (1e-4), and the
accuracy it prints equals the accuracy those scores give; malformed items are refused by line."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_domino.config import ConfigError, load_config
from megatron_domino.generation.multiple_choice import choice_log_likelihood, read_items
from tests.test_convert import _load_native
from tests.test_generate import converted
from tests.training_runs import REPO, environment

pytest.importorskip("transformers")


def _items(count=12, seed=0):
    g = np.random.default_rng(seed)
    return [{"context_ids": g.integers(1, 200, g.integers(2, 6)).tolist(),
             "choice_ids": [g.integers(1, 200, g.integers(1, 4)).tolist() for _ in range(4)],
             "label": int(g.integers(0, 4))} for _ in range(count)]


def _hf_score(hf_model, context, choice) -> float:
    with torch.no_grad():
        logits = hf_model(torch.tensor([context + choice])).logits[0].float()
    scored = torch.log_softmax(logits[len(context) - 1:-1], dim=-1)
    return scored.gather(1, torch.tensor(choice).unsqueeze(1)).sum().item()


def test_scores_and_accuracy_equal_transformers(tmp_path):
    hf_model, native = converted("llama", tmp_path)  # converted at tp 2 x pp 2, scored at tp 1
    tasks = tmp_path / "items.jsonl"
    tasks.write_text("\n".join(json.dumps(item) for item in _items()) + "\n")
    items = read_items(str(tasks), None, text=False)
    model = _load_native(native, load_config(os.path.join(native, "config.yaml")).model).eval()
    right = right_norm = 0
    for context, choices, label, lengths in items:
        ours = [choice_log_likelihood(model, context, c) for c in choices]
        theirs = [_hf_score(hf_model, context, c) for c in choices]
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
        right += int(np.argmax(theirs)) == label
        right_norm += int(np.argmax(np.array(theirs) / np.array(lengths))) == label
    result = subprocess.run([sys.executable, os.path.join(REPO, "tools", "evaluate.py"), "--load", native,
                             "--tasks", str(tasks), "parallel.backend=gloo"], cwd=REPO, env=environment(),
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"accuracy {right / 12:.4f} | acc_norm {right_norm / 12:.4f} | items 12" in result.stdout


@pytest.mark.quick
@pytest.mark.parametrize("line, rule", [
    ({"context_ids": [1], "choice_ids": [[2]], "label": 3}, "label indexing them"),
    ({"context": "a", "choices": ["b"], "label": 0}, "need a text tokenizer"),
    ({"choice_ids": [[2]], "label": 0}, "line 1"),
])
def test_malformed_items_are_refused_by_line(tmp_path, line, rule):
    tasks = tmp_path / "items.jsonl"
    tasks.write_text(json.dumps(line) + "\n")
    with pytest.raises(ConfigError, match=rule):
        read_items(str(tasks), None, text=False)
