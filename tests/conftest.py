"""Every test runs under NCCL's rules: the collective device checks are installed in this process and in every
rank ``tests/harness.py`` starts, and the strict pipeline transport (rendezvous sends, untagged order) is on in
every layout the tests build (``strict=True`` states in ``tests/parity.py``, ``parallel.strict_transport=true``
in ``tests/training_runs.COMMON``); see megatron_domino/parallel/strict.py.

The quick tier: every test not marked ``slow`` is also marked ``quick``, so ``pytest -m quick`` (or
``bash scripts/test.sh -m quick``) runs a few minutes of the suite that still touches every package; the
whole suite stays what CI runs."""
import pytest

from megatron_domino.parallel.strict import install_collective_checks

install_collective_checks()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "slow" not in item.keywords and "sweep" not in item.keywords:
            item.add_marker(pytest.mark.quick)
    if not config.getoption("markexpr"):  # a plain run (CI's): the sweep only when a -m expression asks for it
        swept = [item for item in items if "sweep" in item.keywords]
        if swept:
            config.hook.pytest_deselected(items=swept)
            items[:] = [item for item in items if "sweep" not in item.keywords]
