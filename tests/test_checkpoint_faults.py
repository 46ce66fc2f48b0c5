"""Checkpoint folders and files met the way a user meets them: a second run into a busy folder, a fresh start over
published checkpoints, a stale lock and an interrupted save's leftovers, damaged metadata and files, and a launch
that cannot start (a read-only or full disk: tests/test_checkpoint_disk.py). Each asserts the status and the words
of the message, and that nothing already published is lost."""
import json
import os
import pickle
import shutil
import signal
import subprocess
from types import SimpleNamespace

import pytest
import torch

from megatron_domino import checkpoint_format as fmt
from megatron_domino.checkpoint_format import tensors
from megatron_domino.config import load_config
from megatron_domino.config.errors import CheckpointError, LaunchError
from megatron_domino.models.language_model import LanguageModel
from megatron_domino.parallel.launch import device_for
from megatron_domino.parallel.random import RNGTracker
from megatron_domino.parallel.store_barrier import StoreBarriers
from megatron_domino.training.checkpoint import Checkpointer
from megatron_domino.training.checkpoint_dir import LOCK
from tests.test_runtime_faults import report
from tests.training_runs import REPO, TINY, command, environment, kill_group, metrics, start, train, wait_for_step

STEP2, STEP3 = fmt.step_dir_name(2), fmt.step_dir_name(3)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A checkpoint root holding steps 1 to 3 of a tiny run (``latest``: step 3)."""
    run = str(tmp_path_factory.mktemp("published") / "run")
    train("gpt", 1, run, ["train.steps=3", "checkpoint.interval=1", "checkpoint.keep=0"])
    return os.path.join(run, "checkpoints")


@pytest.fixture
def root(published, tmp_path):
    """A private copy of ``published``, to damage."""
    return shutil.copytree(published, str(tmp_path / "checkpoints"))


def snapshot(root: str) -> dict:
    """Every published file under ``root`` and its bytes: what must survive a refused run."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name != LOCK:
                with open(os.path.join(folder, name), "rb") as f:
                    out[os.path.relpath(os.path.join(folder, name), root)] = f.read()
    return out


def run_cli(run_dir: str, overrides: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command("gpt", 1, run_dir, overrides), cwd=REPO, env=environment(), capture_output=True,
                          text=True, timeout=240)


def assert_one_block(result, *words) -> None:
    err = result.stderr
    assert result.returncode == 1, err[-4000:]
    assert err.count("CheckpointError: ") == 1 and "Traceback" not in err, err[-4000:]
    for word in words:
        assert word in err, (word, err[-4000:])


@pytest.mark.slow
def test_a_second_run_into_the_same_folder_is_refused_naming_the_first(tmp_path):
    first, log = str(tmp_path / "first"), tmp_path / "first.txt"
    ckpt = os.path.join(first, "checkpoints")
    proc = start("gpt", 1, first, ["train.steps=500", "checkpoint.interval=2", "checkpoint.keep=0"], str(log))
    try:
        wait_for_step(first, 3, proc)
        published = snapshot(os.path.join(ckpt, STEP2))  # saved before step 3 was logged
        second = run_cli(str(tmp_path / "second"), [f"checkpoint.dir={ckpt}", "checkpoint.load=auto"])
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
    finally:
        kill_group(proc)
    assert_one_block(second, f"checkpoint.dir = '{ckpt}' is in use by the run of pid {proc.pid}",
                     "Fix: give this run another checkpoint.dir")
    assert metrics(str(tmp_path / "second")) == []
    assert snapshot(os.path.join(ckpt, STEP2)) == published
    assert not os.path.exists(os.path.join(ckpt, LOCK))  # released at the end
    assert not [n for n in os.listdir(ckpt) if n.startswith(fmt.TMP_PREFIX)]


@pytest.mark.slow
def test_a_fresh_start_over_published_checkpoints_is_refused(root, tmp_path):
    before = snapshot(root)
    result = run_cli(str(tmp_path / "run"), [f"checkpoint.dir={root}"])
    assert_one_block(result, "already holds checkpoints", "a fresh start would publish over them",
                     "Fix: checkpoint.load=auto to resume from them")
    assert snapshot(root) == before and not os.path.exists(os.path.join(root, LOCK))


@pytest.mark.slow
def test_a_stale_lock_is_taken_over_and_leftovers_are_removed(root, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    with open(os.path.join(root, LOCK), "w") as f:
        json.dump({"host": os.uname().nodename, "pid": dead.pid, "run_id": "gone", "started": "earlier"}, f)
    leftover = fmt.start_step_dir(root, 4, "gone")  # a save interrupted by a full disk or a kill
    before = snapshot(root)
    result = train("gpt", 1, str(tmp_path / "run"), [f"checkpoint.dir={root}", "checkpoint.load=auto",
                                                    "train.steps=4", "checkpoint.keep=0"])
    assert f"taking over the lock of the run of pid {dead.pid}" in result.stderr
    assert f"its process {dead.pid} is no longer running" in result.stderr
    assert f"removed {leftover}, left by an interrupted save" in result.stderr
    assert not os.path.exists(leftover) and not os.path.exists(os.path.join(root, LOCK))
    after = snapshot(root)
    assert all(after[name] == data for name, data in before.items() if not name.startswith("latest"))
    assert fmt.resolve_load_path("auto", root).endswith(fmt.step_dir_name(4))


def _truncate(path: str, keep: int) -> None:
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:keep])


def _edit_metadata(step_dir: str, **changes) -> None:
    path = os.path.join(step_dir, fmt.METADATA)
    with open(path) as f:
        meta = json.load(f)
    with open(path, "w") as f:
        json.dump({**meta, **changes}, f)


SHARD = "__0_0.distcp"  # what the single rank of the fixture wrote
INDEX_DAMAGED = "/.metadata (the tensor index) is missing or damaged"


class _RunsCode:
    """Unpickles to a shell command: a checkpoint index must never be loaded with plain pickle."""

    def __reduce__(self):
        return os.system, ("echo unpickled",)


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


DAMAGE = {
    "negative consumed_samples": (lambda s: _edit_metadata(s, consumed_samples=-50),
                                  "consumed_samples = -50 is not a non-negative integer"),
    "step of another folder": (lambda s: _edit_metadata(s, step=7),
                               "step = 7 differs from its folder's step 3"),
    "truncated metadata": (lambda s: _truncate(os.path.join(s, fmt.METADATA), 40), "metadata.json is not valid JSON"),
    "truncated shard": (lambda s: _truncate(os.path.join(s, SHARD), 3000), f"{SHARD} is truncated (3000 of "),
    "missing shard": (lambda s: os.remove(os.path.join(s, SHARD)), f"{SHARD} is missing"),
    "missing index": (lambda s: os.remove(os.path.join(s, tensors.INDEX)), INDEX_DAMAGED),
    "edited index": (lambda s: _truncate(os.path.join(s, tensors.INDEX), 500), INDEX_DAMAGED),
    "index that runs code": (lambda s: _write_bytes(os.path.join(s, tensors.INDEX), pickle.dumps(_RunsCode())),
                             "system is not part of a checkpoint index"),
    "latest names a missing step": (lambda s: _write(os.path.join(os.path.dirname(s), fmt.LATEST),
                                                     '{"step": 9, "dir": "step_00000009"}'),
                                    "latest names step_00000009, which does not exist"),
    "truncated latest": (lambda s: _truncate(os.path.join(os.path.dirname(s), fmt.LATEST), 10),
                         "latest is unreadable (JSONDecodeError"),
}


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_intact_steps(root, case):
    damage, words = DAMAGE[case]
    damage(os.path.join(root, STEP3))
    cfg = load_config(os.path.join(REPO, TINY["gpt"]), [])
    model = LanguageModel(cfg.model)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(0.25)
    state = SimpleNamespace(tp_rank=0, tp_size=1, cp_size=1, pp_size=1, dp_size=1, virtual_pp=1, rank=0,
                            barriers=StoreBarriers("test"))
    with pytest.raises(CheckpointError) as raised_error:
        Checkpointer(cfg, state, RNGTracker()).load(fmt.resolve_load_path("auto", root), chunks=[model],
                                                    optimizer=None, lr_schedule=None)
    message = str(raised_error.value)
    assert words in message, message
    newest = STEP3 if "latest" in case else STEP2  # a damaged latest leaves step 3 itself intact
    assert f"Fix: load an intact checkpoint instead, e.g. the newest: checkpoint.load={root}/{newest}" in message
    assert "(intact in" in message and fmt.step_dir_name(1) in message
    assert all((param == 0.25).all() for param in model.parameters())  # nothing loaded silently


@pytest.mark.slow
def test_a_step_that_is_not_a_number_is_one_block_not_a_type_error(root, tmp_path):
    _edit_metadata(os.path.join(root, STEP3), step="four")
    result = run_cli(str(tmp_path / "run"), [f"checkpoint.load={root}", "train.steps=5",
                                              "checkpoint.save_at_end=false", f"checkpoint.dir={tmp_path}/new"])
    assert_one_block(result, "step = 'four' is not a non-negative integer",
                     f"checkpoint.load={root}/{STEP2}")
    assert metrics(str(tmp_path / "run")) == []


def test_a_launch_error_is_one_block(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # backend nccl on a node without GPUs
    with pytest.raises(LaunchError) as error:
        device_for("nccl")
    assert report(error.value, tmp_path) == 1
    err = capsys.readouterr().err
    assert err.startswith("[rank 0] LaunchError: parallel.backend = nccl but this process sees no CUDA device")
    assert "\n  Fix: request GPUs for every task" in err and "Traceback" not in err


def test_a_write_that_fails_is_a_checkpoint_error_naming_the_folder(tmp_path):
    """What the disk refuses (here: a file where the step folder should be) is one error, not DCP's traceback."""
    blocked = tmp_path / "step"
    blocked.write_text("not a folder")
    piece = tensors.Piece((0,), (2,), torch.ones(2))
    with pytest.raises(CheckpointError, match=rf"writing the checkpoint into {blocked} failed \(rank 0: "
                                              r"FileExistsError: .*File exists.*\); nothing was published"):
        tensors.write(str(blocked), {"model/w": tensors.Stored((2,), torch.float32, [piece])})


def _one_rank_asks_for_a_missing_tensor(rank, world_size, step_dir):
    import torch.distributed as dist
    group = dist.new_group(backend="gloo")
    tensors.write(step_dir, {"model/w": tensors.Stored((4,), torch.float32,
                                                       [tensors.Piece((2 * rank,), (2,), torch.full((2,), rank))])},
                  group=group)
    wanted = {"model/w": [tensors.Piece((0,), (4,), torch.empty(4))]}
    if rank == 1:  # only this rank's slice names a tensor the checkpoint does not hold
        wanted["model/missing"] = [tensors.Piece((0,), (1,), torch.empty(1))]
    try:
        tensors.read(step_dir, wanted, group=group)
    except CheckpointError as error:
        return str(error)
    return "loaded"


def test_a_tensor_missing_on_one_rank_stops_every_rank_at_once(tmp_path):
    """Rank 1 alone finds a tensor missing; rank 0 must not wait for it in DCP's collectives until the timeout."""
    from tests.harness import run_ranks
    errors = run_ranks(_one_rank_asks_for_a_missing_tensor, 2, str(tmp_path / "step"), timeout=60)
    for error in errors:
        assert "rank 1: " in error and "has no tensor 'model/missing'" in error, errors
