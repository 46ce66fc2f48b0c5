"""metrics.jsonl after a resume: the records of steps past the checkpoint, which the new attempt writes again,
move to metrics.superseded.jsonl (with a line the crash cut short), so each step is in metrics.jsonl once (a
restart end to end: tests/test_restart.py)."""
import json
import os

import pytest

from megatron_domino.training.metrics import MetricsWriter


def _records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.quick
def test_a_resume_sets_the_later_steps_aside_and_appends_after_the_rest(tmp_path):
    writer = MetricsWriter(str(tmp_path), True, False)
    for step in range(1, 7):
        writer.write({"step": step, "loss": 10.0 - step})
        if step % 3 == 0:
            writer.write({"step": step, "split": "valid", "loss": 9.0})
    writer.close()
    with open(writer.jsonl_path, "a", encoding="utf-8") as f:
        f.write('{"step": 7, "lo')  # the crash cut the last line short
    writer = MetricsWriter(str(tmp_path), True, False)
    writer.resume_at(3)
    writer.write({"step": 4, "loss": 5.5})
    writer.close()
    kept = _records(writer.jsonl_path)
    assert [(r["step"], r.get("split")) for r in kept] == [(1, None), (2, None), (3, None), (3, "valid"), (4, None)]
    assert kept[-1]["loss"] == 5.5
    with open(os.path.join(tmp_path, "metrics.superseded.jsonl"), encoding="utf-8") as f:
        aside = f.read().splitlines()
    assert aside[-1] == '{"step": 7, "lo'
    assert [(r["step"], r.get("split")) for r in map(json.loads, aside[:-1])] == \
        [(4, None), (5, None), (6, None), (6, "valid")]


@pytest.mark.quick
def test_a_resume_with_nothing_later_leaves_the_file_alone(tmp_path):
    writer = MetricsWriter(str(tmp_path), True, False)
    writer.write({"step": 1, "loss": 2.0})
    writer.resume_at(1)
    writer.close()
    assert _records(writer.jsonl_path) == [{"step": 1, "loss": 2.0}]
    assert not os.path.exists(os.path.join(tmp_path, "metrics.superseded.jsonl"))
