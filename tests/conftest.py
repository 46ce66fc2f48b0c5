"""Every test runs under NCCL's rules: the strict pipeline transport (rendezvous sends, untagged order) and the
collective device checks are on for every rank the tests start, in-process or through torchrun
(see megatron_domino/parallel/strict.py).

The quick tier: every test not marked ``slow`` is also marked ``quick``, so ``pytest -m quick`` (or
``bash scripts/test.sh -m quick``) runs a few minutes of the suite that still touches every package; the
whole suite stays what CI runs."""
import os

import pytest

from megatron_domino.parallel.strict import ENV_SWITCH

os.environ[ENV_SWITCH] = "1"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "slow" not in item.keywords:
            item.add_marker(pytest.mark.quick)
