"""benchmarks/gpu_check.sh offline, as on the GPU machine (no package registry): a short DRY run whose pip index
does not answer. The script must notice that itself within seconds (GPU_CHECK_OFFLINE is not set), run no
``pip install``, skip what is missing with its reason, pass, and print the table last."""
import os
import subprocess
import sys

import pytest

from tests.training_runs import REPO, environment

pytestmark = pytest.mark.slow  # multi-rank training runs: the whole suite, not -m quick

KNOBS = ("GPU_CHECK_OFFLINE", "PIP_NO_INDEX", "PIP_INDEX_URL", "MCORE_WHEELS", "SKIP", "STEPS", "INTERVAL",
         "CUDA_TESTS", "MBS", "GBS", "PEAK_TFLOPS", "PYTHON", "GPU_CHECK_OUT", "CUDA_VISIBLE_DEVICES")


def test_dry_run_without_a_registry_installs_nothing_and_ends_with_the_table(tmp_path):
    calls = tmp_path / "python-calls.txt"
    python = tmp_path / "python"  # records how the script calls Python, then runs this interpreter
    python.write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    env = {k: v for k, v in environment().items() if k not in KNOBS}
    env.update(DRY="1", PIP_INDEX_URL="http://127.0.0.1:9/simple", PYTHON=str(python), STEPS="4",
               GPU_CHECK_OUT=str(tmp_path / "out"), SKIP="domino-parity",
               CUDA_TESTS="tests/test_cuda.py::test_sync_debug_mode_raises_on_a_host_sync")
    result = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "gpu_check.sh")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]

    assert "== registry: offline (http://127.0.0.1:9/simple does not answer" in out, out[:2000]
    probe = next(line for line in out.splitlines() if line.startswith("== registry:"))
    assert int(probe.split("; ")[1].split("s)")[0]) <= 5, probe  # decided at once, not after pip's retries
    pip = [line for line in calls.read_text().splitlines() if line.startswith("-m pip")]
    assert pip == [], pip  # no install, not even a look at pip's config (the index came from PIP_INDEX_URL)
    assert "== install (limit" not in out and "== install-megatron-core (limit" not in out, out[:3000]
    if "megatron-core: missing" in out:
        assert "== megatron-core: skipped (megatron-core is not installed, offline" in out, out
    assert "== unit-tests (limit" in out and "== train (limit" in out and "== domino-parity: skipped" in out
    for timed in ("rehearse-timed", "domino-timed", "domino-timed-ib"):  # one device as one rank, timed links
        assert f"== {timed} (limit" in out and f"-- {timed}\n" in out, out[-6000:]
    assert "the job's step predicted from the roles' instructions" in out and "hidden (waits)" in out, out[-6000:]

    lines = out.rstrip("\n").splitlines()
    verdict, header, rule, ours, mcore, *variants = lines[-11:]
    assert verdict.startswith("gpu_check: PASSED in ") and "domino-parity (SKIP)" in verdict, lines[-10:]
    assert header.split()[:3] == ["run", "tokens/s", "TFLOP/s"] and set(rule) <= {"-", " "}, lines[-10:]
    assert ours.startswith("megatron_domino ") and "n/a" not in ours, ours
    assert mcore.startswith("megatron-core"), mcore
    ours_variants, torchao = variants[:4], variants[4:]
    for variant, name in zip(ours_variants, ("compile", "fp8-tensorwise-compile", "fp8-delayed-compile",
                                             "fp8-blockwise-compile"), strict=True):
        assert variant.startswith(f"megatron_domino, {name} ") and "n/a" not in variant, variant
    for variant, recipe in zip(torchao, ("tensorwise", "rowwise"), strict=True):  # n/a without torchao
        assert variant.startswith(f"torchao {recipe} (Float8Linear, compiled)"), variant
