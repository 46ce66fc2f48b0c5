"""Metric sinks: wandb in offline mode without a network (nothing imported otherwise), and TensorBoard."""
import glob
import os
import time
import subprocess
import sys

import pytest

from megatron_domino.training.metrics import MetricsWriter
from tests.training_runs import REPO, environment


def test_wandb_is_not_imported_unless_enabled(tmp_path):
    code = ("import sys; from megatron_domino.training.metrics import MetricsWriter; "
            f"w = MetricsWriter({str(tmp_path)!r}, True, False); w.write({{'step': 1, 'loss': 2.0}}); w.close(); "
            "assert 'wandb' not in sys.modules, 'wandb imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=environment(), check=True, timeout=120)


def test_offline_run_records_train_and_valid_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = MetricsWriter(str(tmp_path), True, False, ("tests", "offline", {"train": {"steps": 2}}))
    writer.write({"step": 1, "loss": 3.0, "lr": 1e-3})
    writer.write({"step": 1, "split": "valid", "loss": 2.5})
    writer.close()
    runs = glob.glob(os.path.join(tmp_path, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1
    deadline, data = time.monotonic() + 60, b""
    while time.monotonic() < deadline:  # wandb's service process may still be writing under a loaded machine
        with open(runs[0], "rb") as f:  # the run's records (protobuf) carry the keys as plain bytes
            data = f.read()
        if b"train/loss" in data and b"valid/loss" in data:
            break
        time.sleep(0.5)
    assert b"train/loss" in data and b"valid/loss" in data, data[:200]


def test_tensorboard_gets_every_number_and_every_expert_share(tmp_path):
    """Lists in a record (an MoE run's per-layer, per-expert token shares) reach TensorBoard one scalar per entry."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    writer = MetricsWriter(str(tmp_path), True, True)
    writer.write({"step": 3, "loss": 2.0, "moe_expert_share": [[0.25, 0.75], [0.5, 0.5]]})
    writer.close()
    events = EventAccumulator(os.path.join(tmp_path, "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"train/loss", "train/moe_expert_share/0/0", "train/moe_expert_share/0/1",
                    "train/moe_expert_share/1/0", "train/moe_expert_share/1/1"}
    assert [(e.step, e.value) for e in events.Scalars("train/moe_expert_share/0/1")] == [(3, 0.75)]
