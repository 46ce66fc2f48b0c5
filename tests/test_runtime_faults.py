"""Runtime faults met the way a user meets them: data beyond the vocabulary, Ctrl-C, a bad planner argument,
and how a failure reads (a short block for a known error, the traceback for a bug, a reporter that never fails)."""
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_domino.config import Config
from megatron_domino.config.errors import DataError
from megatron_domino.data import IndexedDatasetBuilder
from megatron_domino.training import cli
from megatron_domino.training.trainer import Trainer
from megatron_domino.training.watchdog import Watchdog
from tests.test_training import _resume_one_step
from tests.training_runs import REPO, command, environment, kill_group, metrics, start, wait_for_step

VOCAB = 1024  # configs/tiny/gpt.yaml


def write_dataset_with_an_id_beyond_the_vocabulary(prefix) -> None:
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(str(prefix), np.uint16) as builder:
        for k in range(100):
            doc = rng.integers(0, VOCAB - 1, 60)
            if k == 37:
                doc[10] = 5000
            builder.add_document(doc)
        builder.finalize()


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_token_id_beyond_the_vocabulary_stops_the_run_before_step_1(tmp_path, tp):
    prefix, run = tmp_path / "corpus", tmp_path / "run"
    write_dataset_with_an_id_beyond_the_vocabulary(prefix)
    result = subprocess.run(command("gpt", tp, str(run), ["data.mock=false", f"data.path=[{prefix}]",
                                                          f"parallel.tp={tp}", "train.steps=4"]),
                            cwd=REPO, env=environment(), capture_output=True, text=True, timeout=240)
    err = result.stderr
    assert result.returncode == 1, err[-4000:]
    assert err.count("DataError: ") == 1, err[-4000:]  # one block, however many ranks saw the bad file
    assert f"{prefix}.bin: document 37 (counting from 0) holds token id 5000" in err, err[-4000:]
    assert "model.vocab_size = 1024" in err and "\n  Fix: preprocess the corpus" in err
    assert "] Traceback" not in err  # the traceback goes to the log, not the console
    logs = [run / f"error-rank{r}.log" for r in range(tp) if (run / f"error-rank{r}.log").exists()]
    assert logs and all("Traceback" in log.read_text() and "DataError" in log.read_text() for log in logs)
    assert metrics(str(run)) == []  # not one step trained on the bad ids


@pytest.mark.slow
def test_ctrl_c_saves_at_the_next_step_and_exits_zero(tmp_path):
    run, log = str(tmp_path / "run"), tmp_path / "log.txt"
    proc = start("gpt", 1, run, ["train.steps=500"], str(log))
    try:
        wait_for_step(run, 3, proc)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
    finally:
        kill_group(proc)
    text = log.read_text()
    assert "interrupt: saving a checkpoint at the next step boundary" in text and "Traceback" not in text
    assert 3 <= _resume_one_step(tmp_path, os.path.join(run, "checkpoints")) < 500


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once_without_saving(tmp_path):
    run, log = str(tmp_path / "run"), tmp_path / "log.txt"
    proc = start("gpt", 1, run, ["train.steps=500", "train.global_batch_size=64"], str(log))  # ~1 s steps
    try:
        wait_for_step(run, 2, proc)
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.2)  # the save waits for the step after next
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 130, log.read_text()[-4000:]
    finally:
        kill_group(proc)
    assert "second interrupt: exiting now without saving" in log.read_text()
    assert not os.path.exists(os.path.join(run, "checkpoints", "latest"))


def test_plan_refuses_a_cluster_of_no_nodes():
    result = subprocess.run([sys.executable, "tools/plan.py", "--model", "tiny-gpt", "--nodes", "0"], cwd=REPO,
                            env=environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "argument --nodes: must be 1 or more, got 0" in result.stderr


def raised(error: BaseException) -> BaseException:
    """``error`` with a traceback, as the reporter receives it."""
    try:
        raise error
    except BaseException as caught:  # noqa: BLE001
        return caught


def report(error: BaseException, log_dir) -> int:
    """The command line's failure report of ``error`` (raised) for a default run logging to ``log_dir``."""
    cfg = Config()
    cfg.log.dir = str(log_dir)
    return cli._report_failure(raised(error), cfg)


def test_a_known_error_is_a_block_and_a_bug_keeps_its_traceback(tmp_path, capsys):
    assert report(DataError("x.bin is damaged. Fix: re-run it"), tmp_path) == 1
    err = capsys.readouterr().err
    assert err.startswith("[rank 0] DataError: x.bin is damaged.\n  Fix: re-run it\n") and "Traceback" not in err
    assert "Traceback" in (tmp_path / "error-rank0.log").read_text()
    assert report(ValueError("a bug"), tmp_path) == 1
    err = capsys.readouterr().err
    assert "[rank 0] Traceback" in err and "[rank 0] ValueError: a bug" in err


def test_the_reporter_never_fails_itself(tmp_path, capsys):
    class Unprintable(Exception):
        def __str__(self):
            raise TypeError("no text")

    assert report(Unprintable(), tmp_path) == 1
    assert "Unprintable" in capsys.readouterr().err
    # step "four" read from damaged checkpoint metadata: describing the rank's state fails, the report does not
    trainer = SimpleNamespace(step="four", phase="data")
    watchdog = SimpleNamespace(close=lambda: None, interval_s=0.0, describe_silent_peers=lambda wait_s: "none",
                               state=SimpleNamespace(coordinates=lambda: "rank 0"),
                               describe=lambda: Trainer.describe(trainer))
    Watchdog.report_failure(watchdog, raised(TypeError("'>=' not supported")))
    assert "[rank 0] failed while in: a state that cannot be described (TypeError" in capsys.readouterr().err
