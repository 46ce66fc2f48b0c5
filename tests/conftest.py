"""Every test runs under NCCL's rules: the collective device checks are installed in this process and in every
rank ``tests/harness.py`` starts, and the strict pipeline transport (rendezvous sends, untagged order) is on in
every layout the tests build (``strict=True`` states in ``tests/parity.py``, ``parallel.strict_transport=true``
in ``tests/training_runs.COMMON``); see megatron_domino/parallel/strict.py.

The tiers (docs/design/testing.md): every test not marked ``slow`` is also marked ``quick``, so ``pytest -m quick``
runs a few minutes of the suite that still touches every package; a plain run (CI's) leaves out ``sweep`` and
``mutation``, which run only when a ``-m`` expression names them.

One inductor cache serves the whole run: its folder is set here, before any process starts, so every rank, child
interpreter and compiled test reuses the graphs another compiled (a fresh cache per test compiled them again)."""
import atexit
import os
import shutil
import tempfile

import pytest
import torch.distributed as dist

from megatron_domino.parallel.strict import install_collective_checks

install_collective_checks()

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

_ASKED_FOR = ("sweep", "mutation")  # tiers that run only when a -m expression names them


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(mark in item.keywords for mark in ("slow", *_ASKED_FOR)):
            item.add_marker(pytest.mark.quick)
    expression = config.getoption("markexpr")
    left_out = [item for item in items if any(mark in item.keywords and mark not in expression
                                               for mark in _ASKED_FOR)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]


@pytest.fixture
def no_process_group(monkeypatch):
    """Starting a process group fails the test: what must be refused before any group starts is refused before
    this hook could run (a group started and destroyed again would pass a look at ``dist.is_initialized()``)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a process group was started")

    for name in ("init_process_group", "new_group"):
        monkeypatch.setattr(dist, name, refuse)
