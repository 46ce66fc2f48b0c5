"""Mutation checks: each headline claim's tests fail when the library is broken the way the claim rules out.

``python -m pytest -m mutation`` (left out of every other run, tests/conftest.py). For each mutation of
``tests/mutations.py`` the repository is copied to a temporary folder, the mutation's source patch applied there (its
text must occur exactly once, so a mutation that no longer applies fails instead of passing unseen), and the tests
it names run in a child pytest of that copy: the mutation is killed when they fail (pytest's status 1). A status 0
means it survived, any other (a collection error, no test found) that the mutation is broken; both fail here. The
child is a process of its own, so no patched module reaches this one; it shares this run's inductor cache and the
fake CUDA library's, which are keyed by their sources.
"""
import os
import shutil
import subprocess
import sys

import pytest

from tests.mutations import MUTATIONS
from tests.training_runs import REPO, environment

pytestmark = pytest.mark.mutation
_COPIED = ("megatron_domino", "tests", "configs", "tools", "benchmarks", "scripts", "docs", "pretrain_gpt.py",
           "pretrain_llama.py", "pytest.ini", "setup.py", "README.md", ".importlinter")
_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")


def mutated_copy(mutation, root: str) -> str:
    """The repository under ``root`` with ``mutation`` applied; its path."""
    for name in _COPIED:
        source = os.path.join(REPO, name)
        if os.path.isdir(source):
            shutil.copytree(source, os.path.join(root, name), ignore=_IGNORED)
        elif os.path.exists(source):
            shutil.copy2(source, os.path.join(root, name))
    path = os.path.join(root, mutation.path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    found = text.count(mutation.old)
    assert found == 1, f"{mutation.name}: its text occurs {found} times in {mutation.path}, not once: update it"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(mutation.old, mutation.new))
    return root


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_the_claims_tests_kill_the_mutation(mutation, tmp_path):
    root = mutated_copy(mutation, str(tmp_path / "repo"))
    env = dict(environment(), PYTHONPATH=root, PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not mutation or sweep"]
    done = subprocess.run([*command, *mutation.tests], cwd=root, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    tail = (done.stdout[-3000:] + done.stderr[-2000:]).strip()
    assert done.returncode != 0, f"{mutation.name} survived {' '.join(mutation.tests)} ({mutation.claim}):\n{tail}"
    assert done.returncode == 1, f"{mutation.name}: the tests did not run (pytest status {done.returncode}):\n{tail}"
