"""Launching real training runs from tests: forked ranks, bare processes or torchrun, with a hard timeout."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"gpt": "configs/tiny/gpt.yaml", "llama": "configs/tiny/llama.yaml", "mixtral": "configs/tiny/mixtral.yaml",
        "qwen3": "configs/tiny/qwen3.yaml", "qwen3_moe": "configs/tiny/qwen3_moe.yaml",
        "deepseek_v3": "configs/tiny/deepseek_v3.yaml"}
ENTRY = {"gpt": "pretrain_gpt.py", **{family: "pretrain_llama.py" for family in TINY if family != "gpt"}}
# Tests use synthetic tokens (no corpus needed), gloo (several ranks may share one GPU), NCCL's rules emulated
# (strict transport and collective checks) and small, fast runs.
COMMON = ["data.mock=true", "tokenizer.type=NullTokenizer", "tokenizer.model=null", "log.tensorboard=false",
          "optimizer.warmup_steps=2", "parallel.timeout_s=60", "parallel.backend=gloo",
          "parallel.strict_transport=true"]


def script_args(family: str, run_dir: str, overrides: list[str]) -> list[str]:
    """The entry script and its arguments: what follows ``python`` or torchrun's options."""
    return [os.path.join(REPO, ENTRY[family]), "--config", os.path.join(REPO, TINY[family]), *COMMON,
            f"log.dir={run_dir}", f"checkpoint.dir={run_dir}/checkpoints", *overrides]


def command(family: str, nproc: int, run_dir: str, overrides: list[str]) -> list[str]:
    args = script_args(family, run_dir, overrides)
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def environment() -> dict:
    """This process's environment without any launcher's variables (a test may itself run under torchrun/slurm)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES and not k.startswith("SLURM_")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def train(family: str, nproc: int, run_dir: str, overrides: list[str],
          timeout: float = 240) -> subprocess.CompletedProcess:
    """A whole run that must succeed, its ranks forked from a preloaded server (tests/forked_ranks.py says why and
    what stays on torchrun); its output joined in rank order."""
    from tests.forked_ranks import run
    result = run(script_args(family, run_dir, overrides), nproc, environment(), REPO, timeout)
    if result.returncode != 0:
        raise AssertionError(f"training failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-6000:]}")
    return result


def start(family: str, nproc: int, run_dir: str, overrides: list[str], log_path: str) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen(command(family, nproc, run_dir, overrides), cwd=REPO, env=environment(),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def metrics(run_dir: str, split: str | None = None) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("split") == split] if split else [r for r in records if "split" not in r]


def losses(run_dir: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir)}


def wait_for_step(run_dir: str, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if max(losses(run_dir), default=0) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended (status {proc.returncode}) before step {step}")
        time.sleep(0.2)
    raise AssertionError(f"run did not reach step {step} within {timeout}s")


def worker_pids(launcher_pid: int) -> list[int]:
    """The training ranks: children of the torchrun launcher."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().split(")")[-1].split()[1]) == launcher_pid:
                        children.append(int(entry))
            except OSError:
                continue
    return sorted(children)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def start_ranks(family: str, world: int, run_dir: str, overrides: list[str], log_dir: str) -> list[subprocess.Popen]:
    """The ranks as independent processes (as srun without --kill-on-bad-exit starts them): no launcher
    tears the job down, so each rank must find out about a dead peer by itself."""
    from megatron_domino.parallel.launch import free_port
    port, procs = free_port(), []
    os.makedirs(log_dir, exist_ok=True)
    for rank in range(world):
        env = dict(environment(), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
        procs.append(subprocess.Popen(command(family, 1, run_dir, overrides), cwd=REPO, env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs
