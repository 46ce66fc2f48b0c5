"""Every shell command of docs/getting-started.md and docs/data.md runs on a CPU, in the pages' order, at small sizes:
a training command gets a few steps more of overrides, and nothing else is changed. The commands run in a fresh
folder that links the repository's entry points, so what they write (data/, runs/) stays there."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ("docs/getting-started.md", "docs/data.md")
LINKED = ("megatron_domino", "tools", "configs", "scripts", "pretrain_gpt.py", "pretrain_llama.py")
# Commands that install into this environment or run the test suite itself are not run here; the quick start's
# own steps are the next block of getting-started.md, and they are.
NOT_RUN = ("pip install", "bash scripts/quickstart.sh", "bash scripts/test.sh")
SMALL = "train.steps=2 optimizer.warmup_steps=1 train.eval_interval=2 train.eval_iters=1"

pytestmark = pytest.mark.slow


def shell_commands(text: str) -> list[str]:
    """The commands of a page's ```bash blocks: continuation lines joined, comment lines dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        joined = re.sub(r"\\\n\s*", "", block)
        commands += [line.strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]
    return commands


def small(command: str) -> str:
    """A training command with the overrides that keep it to two steps; any other command as it is."""
    trains = re.search(r"\bpretrain_(gpt|llama)\.py\b", command) and not re.search(r"--dry-run|--print-schedule",
                                                                                  command)
    return f"{command} {SMALL}" if trains else command


def test_the_shell_commands_of_the_pages_run(tmp_path):
    commands = []
    for page in PAGES:
        with open(os.path.join(REPO, page), encoding="utf-8") as f:
            commands += shell_commands(f.read())
    run = [c for c in commands if not c.startswith(NOT_RUN)]
    assert len(run) >= 10 and len(commands) - len(run) <= 5, commands
    for name in LINKED:
        os.symlink(os.path.join(REPO, name), tmp_path / name)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    for command in run:
        result = subprocess.run(["bash", "-c", small(command)], check=False, cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert (tmp_path / "runs/tiny-gpt/metrics.png").exists() and (tmp_path / "data/my_text_document.bin").exists()
