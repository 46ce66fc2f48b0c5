"""benchmarks/fp8_overhead.py --compile end to end on a tiny GPT (the plumbing: a row per mode, a quantising share
that is zero without FP8 and positive with it)."""
import json
import subprocess
import sys

import pytest

from tests.training_runs import REPO, environment

pytestmark = pytest.mark.slow
MODES = ("off", "tensorwise", "delayed", "blockwise", "off+compile", "tensorwise+compile")


def test_tiny_run_reports_every_mode(tmp_path):
    path = tmp_path / "fp8_overhead.json"
    result = subprocess.run([sys.executable, "benchmarks/fp8_overhead.py", "--hidden", "64", "--heads", "4",
                             "--layers", "2", "--seq", "64", "--vocab", "256", "--rounds", "1", "--block", "32",
                             "--compile", "--json", str(path)],
                            cwd=REPO, env=environment(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()
            if line.split() and line.split()[0] in MODES}
    assert sorted(rows) == sorted(MODES), result.stdout
    assert all((rows[m][4] == "0.0%") is m.startswith("off") for m in rows), result.stdout
    assert all(float(rows[m][4].rstrip("%")) > 0 for m in rows if not m.startswith("off"))
    record = json.loads(path.read_text())
    assert all(len(record["seconds"][mode]) == 2 for mode in rows)  # one warm-up, one timed round


def test_kernel_counts_keep_a_compiled_fp8_linear_within_four_kernels_of_bf16(tmp_path):
    """benchmarks/fp8_kernels.py: the JSON has bf16's, torchao's (None without torchao) and each recipe's eager and
    compiled counts; compiled tensorwise launches at most 4 kernels more than bf16 forward + backward, and
    compiling never adds kernels. Slow: inductor compiles each recipe's casts (~2 min)."""
    path = tmp_path / "kernels.json"
    result = subprocess.run([sys.executable, "benchmarks/fp8_kernels.py", "--json", str(path)], cwd=REPO,
                            env=environment(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    record = json.loads(path.read_text())
    assert {"bf16", "torchao", "tensorwise", "delayed", "blockwise"} <= set(record)
    assert record["tensorwise"]["compiled"] <= record["bf16"] + 4, record
    for recipe in ("tensorwise", "delayed", "blockwise"):
        assert 0 < record[recipe]["compiled"] <= record[recipe]["eager"], (recipe, record)
