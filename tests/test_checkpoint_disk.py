"""A checkpoint folder on a read-only or full disk: refused before step 1, with the fix, and nothing published lost.

The disk fails as a read-only bind mount or a 1 MiB tmpfs would, at the calls the library makes (a write opened
there raises EROFS; the free space reads 1 MiB): mounting needs root, which CI does not have, so these tests
skipped there; injected, they run anywhere."""
import os
import shutil
import subprocess
import sys
import warnings

import pytest

from megatron_domino.config import load_config
from megatron_domino.training.checkpoint_dir import prepare_run_dirs
from tests import test_checkpoint_faults as faults
from tests.test_checkpoint_faults import assert_one_block, snapshot
from tests.training_runs import REPO, TINY, environment, metrics, script_args

pytestmark = pytest.mark.slow
published, root = faults.published, faults.root  # the fixtures: a published checkpoint root, a private copy

# The entry point on a faulty disk: argv[1] the folder, argv[2] the fault, then the script and its arguments.
_FAULTY_DISK = """
import builtins, errno, os, runpy, shutil, sys
folder, fault = os.path.abspath(sys.argv[1]), sys.argv[2]
inside = lambda path: os.path.abspath(str(path)).startswith(folder)
if fault == "read-only":
    real_open = builtins.open
    def refusing_open(file, mode="r", *args, **kwargs):
        if inside(file) and any(flag in mode for flag in "wax+"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(file))
        return real_open(file, mode, *args, **kwargs)
    builtins.open = refusing_open
else:
    real_usage = shutil.disk_usage
    shutil.disk_usage = lambda path: real_usage(path)._replace(free=2**20) if inside(path) else real_usage(path)
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_on_a_faulty_disk(run_dir: str, folder: str, fault: str, overrides: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _FAULTY_DISK, folder, fault, *script_args("gpt", run_dir, overrides)],
                          cwd=REPO, env=environment(), capture_output=True, text=True, timeout=240, check=False)


def test_a_read_only_checkpoint_dir_fails_before_step_1(root, tmp_path):
    before = snapshot(root)
    result = run_on_a_faulty_disk(str(tmp_path / "run"), root, "read-only",
                                  [f"checkpoint.dir={root}", "checkpoint.load=auto"])
    assert_one_block(result, f"checkpoint.dir = '{root}' is not writable (Read-only file system",
                     "found before step 1", "Fix: make it writable")
    assert metrics(str(tmp_path / "run")) == []  # not one step computed for a checkpoint that cannot be written
    assert snapshot(root) == before


def test_a_disk_too_small_for_one_checkpoint_warns_or_fails(tmp_path, monkeypatch):
    target = str(tmp_path / "small")
    os.makedirs(target)
    result = run_on_a_faulty_disk(str(tmp_path / "run"), target, "full",
                                  [f"checkpoint.dir={target}", "checkpoint.free_space=fail"])
    assert_one_block(result, f"checkpoint.dir = '{target}' has 0.00 GiB free, less than one checkpoint",
                     "Fix: free space, or point checkpoint.dir at a larger disk")
    assert metrics(str(tmp_path / "run")) == []
    cfg = load_config(os.path.join(REPO, TINY["gpt"]), [f"checkpoint.dir={target}", f"log.dir={tmp_path}/log"])
    usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(path)._replace(free=2**20))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lock = prepare_run_dirs(cfg, rank=0, key="test/run dirs").lock  # checkpoint.free_space=warn, the default
    lock.release()
    assert any("less than one checkpoint" in str(w.message) for w in caught)
    assert os.listdir(target) == []  # probe and lock cleaned up
