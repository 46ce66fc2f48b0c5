"""log.wandb_project: the metrics go to wandb in offline mode without a network; nothing is imported otherwise."""
import glob
import os
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
    assert len(runs) == 1 and os.path.getsize(runs[0]) > 0
    with open(runs[0], "rb") as f:  # the run's records (protobuf) carry the keys as plain bytes
        data = f.read()
    assert b"train/loss" in data and b"valid/loss" in data
