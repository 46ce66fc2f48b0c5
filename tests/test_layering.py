"""The package's layers hold: no package imports one above it (the contract in .importlinter; the code map in
docs/design/architecture.md lists them in its order)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("importlinter", reason="import-linter comes with the test extra: pip install -e .[test]")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_package_imports_one_above_it():
    lint_imports = "from importlinter.cli import lint_imports_command; lint_imports_command()"  # this interpreter's
    result = subprocess.run([sys.executable, "-c", lint_imports, "--no-cache", "--no-logo"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    report = (result.stdout + result.stderr).strip()
    assert result.returncode == 0, (
        "an import goes against the layer order in .importlinter (docs/design/architecture.md: 'Layout of the code'). Fix: move the "
        "imported code down to a lower package, or pass the value in from above. 'No matches for ignored "
        "import' means a listed exception is gone: delete it from .importlinter.\n\n" + report)


def test_code_map_shows_the_contract_order():
    """docs/design/architecture.md's "Layout of the code" lists the packages bottom up in the contract's order (the packages of one
    line of the contract, which are independent, next to each other in any order), so the two agree."""
    with open(os.path.join(REPO, ".importlinter"), encoding="utf-8") as f:
        body = f.read().split("layers =\n", 1)[1]
    top_down = []
    for line in body.splitlines():
        if not line.startswith("    "):
            break
        top_down.append({name.strip() for name in line.split("|")})
    with open(os.path.join(REPO, "docs", "design", "architecture.md"), encoding="utf-8") as f:
        code_map = f.read().split("## Layout of the code", 1)[1].split("```")[1]
    bottom_up = [line.split()[0].rstrip("/").removesuffix(".py") for line in code_map.splitlines()
                 if line.startswith("  ")]
    groups, start = [], 0
    for layer in top_down[::-1]:
        groups.append(set(bottom_up[start:start + len(layer)]))
        start += len(layer)
    assert groups == top_down[::-1] and start == len(bottom_up), (
        f"docs/design/architecture.md's code map lists {bottom_up}; .importlinter's layers, bottom up, are {top_down[::-1]}")
