"""log.profile_steps: each rank of a TP2 run (Domino needs TP) writes a Chrome trace of the window with the
named ranges of the pipeline instructions, the Domino steps, the optimizer step and data loading. The same run
logs to wandb offline (when installed), through the trainer."""
import glob
import importlib.util
import json
import os

import pytest

from tests.training_runs import train

pytestmark = pytest.mark.slow  # multi-rank training runs: the whole suite, not -m quick

RANGES = ("pipeline F0", "pipeline B0", "domino launch layer 0 attention chunk 0", "domino wait layer 1 mlp chunk 1",
          "optimizer step", "data loading")


def test_the_trace_of_the_window_names_every_range(tmp_path):
    wandb = importlib.util.find_spec("wandb") is not None
    train("gpt", 2, str(tmp_path), ["train.steps=3", "log.profile_steps=[2,2]", "parallel.domino=true",
                                   "parallel.tp=2", "checkpoint.save_at_end=false"]
          + (["log.wandb_project=tests", "log.wandb_mode=offline"] if wandb else []), timeout=180)
    assert os.path.exists(tmp_path / "profile" / "trace-rank1.json")
    with open(tmp_path / "profile" / "trace-rank0.json") as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    missing = [name for name in RANGES if name not in names]
    assert not missing, f"{missing} not among {sorted(n for n in names if n and n[0].islower())[:40]}"
    if wandb:
        assert glob.glob(os.path.join(tmp_path, "wandb", "offline-run-*", "run-*.wandb"))


def test_running_out_of_device_memory_dumps_the_allocators_history(tmp_path, monkeypatch):
    """log.oom_snapshot: history recorded from the start, dumped on OutOfMemoryError, which still propagates.
    (The CUDA allocator calls are stood in for: CI has no GPU; on the CPU the snapshot is off.)"""
    import pytest
    import torch

    from megatron_domino.training.profiling import OomSnapshot

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    snapshot = OomSnapshot(str(tmp_path), 3, torch.device("cuda", 0), enabled=True)
    with snapshot.watching():
        pass
    assert calls == [("record", {"max_entries": 100_000})]
    with pytest.raises(torch.cuda.OutOfMemoryError), snapshot.watching():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert calls[-1] == ("dump", os.path.join(str(tmp_path), "profile", "oom-rank3.pickle"))
    assert not OomSnapshot(str(tmp_path), 0, torch.device("cpu"), enabled=True).enabled
