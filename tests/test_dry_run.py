"""--dry-run on one CPU process (a 1024-GPU layout included), and the launch scripts that run it first.

The shell scripts run for real under bash, with ``python``, ``sbatch`` and ``srun`` replaced by stubs that
record their arguments; the recorded dry-run command is then executed in this process, so a template
whose config, layout or world size is broken fails here.
"""
from __future__ import annotations

import glob
import importlib
import os
import re
import shutil
import subprocess

import pytest
import torch.distributed as dist

from megatron_domino.config import ConfigError, load_config
from megatron_domino.training import dry_run as dry_run_module
from megatron_domino.training.dry_run import dry_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = sorted(glob.glob(os.path.join(ROOT, "scripts/slurm/*.sbatch")))
SEP = "\x1f"


@pytest.fixture
def no_collectives(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the dry run must not start a process group or run a collective")

    for name in ("init_process_group", "new_group", "all_reduce", "barrier", "broadcast"):
        monkeypatch.setattr(dist, name, refuse)


def _row(text: str, rank: int) -> list[str]:
    return next(line.split() for line in text.splitlines() if line.split()[:1] == [str(rank)])


def test_dry_run_of_a_1024_gpu_layout_on_one_cpu_process(no_collectives):
    cfg = load_config(os.path.join(ROOT, "configs/gpt/175b.yaml"))
    text = dry_run(cfg, 1024)
    assert "1024 ranks on 128 node(s) x 8" in text and "world 1024 = tp 8 x cp 1 x pp 16 x dp 8" in text
    rows = [line.split() for line in text.splitlines() if re.match(r"^ *\d+ +node", line)]
    assert [int(r[0]) for r in rows] == list(range(8)) + list(range(1016, 1024))
    for rank, host, tp, cp, pp, dp in rows:  # order tp-cp-dp-pp: rank = tp + 8 * dp + 64 * pp; 8 GPUs per node
        assert int(rank) == int(tp) + 8 * int(dp) + 64 * int(pp) and cp == "0"
        assert host == f"node{int(rank) // 8}/gpu{int(rank) % 8}"
    assert _row(text, 1023)[1:] == ["node127/gpu7", "7", "0", "15", "7"]
    assert len(text.splitlines()) < 45, "1024 ranks must print in a compact form"
    assert "tensor parallel: 128 groups of 8, each inside one node" in text
    assert "context parallel (ring order): 1024 groups of 1" in text and "data x context" not in text
    assert "data parallel: 128 groups of 8, spanning nodes; first [0, 8, 16, 24, 32, 40, 48, 56]" in text
    assert "pipeline (stage order): 64 groups of 16" in text
    assert "embedding (first + last stage): 64 groups of 2" in text
    assert "1f1b, 192 micro-batches of 1" in text and "16 on pipeline rank 0" in text
    assert re.search(r"worst pipeline rank 0: .* GiB -> fits", text)


def test_small_world_prints_every_rank_and_memory_in_mib(no_collectives):
    cfg = load_config(os.path.join(ROOT, "configs/tiny/llama.yaml"), ["parallel.tp=2", "parallel.pp=2"])
    text = dry_run(cfg, 8, gpus_per_node=4, gpu="cpu")
    assert [_row(text, r)[2:] for r in range(8)] == [[str(r % 2), "0", str(r // 4), str(r // 2 % 2)] for r in range(8)]
    assert "MiB -> fits" in text


def test_zero3_and_offload_are_printed_and_shrink_the_estimate(no_collectives):
    """ZeRO-3's gathers and the offloaded share are said; sharding the weights lowers the memory estimate."""
    path = os.path.join(ROOT, "configs/tiny/llama.yaml")

    def memory(text):
        return float(re.search(r"worst pipeline rank 0: .* = ([0-9.]+) MiB", text).group(1))
    zero1 = dry_run(load_config(path, ["parallel.dp=8"]), 8, gpu="cpu")
    zero3 = dry_run(load_config(path, ["parallel.dp=8", "optimizer.zero_stage=3", "optimizer.offload=cpu",
                                       "optimizer.offload_fraction=0.5"]), 8, gpu="cpu")
    assert "ZeRO-1 over 8 replicas (dp x cp): optimizer state sharded" in zero1
    assert ("ZeRO-3 over 8 replicas (dp x cp): optimizer state, gradients and weights sharded; each layer all-gathered "
            "before use with 1 layer(s) prefetched, released after its forward and gathered again for its backward; "
            "50% of the optimizer shard offloaded to cpu memory") in zero3
    assert memory(zero3) < memory(zero1)


def test_context_parallel_rings_and_gradient_groups(no_collectives):
    """tp 2 x cp 2 x dp 2 on two 4-GPU nodes, order tp-cp-dp-pp: rank = tp + 2 * cp + 4 * dp."""
    cfg = load_config(os.path.join(ROOT, "configs/tiny/llama.yaml"), ["parallel.tp=2", "parallel.cp=2"])
    text = dry_run(cfg, 8, gpus_per_node=4, gpu="cpu")
    assert "world 8 = tp 2 x cp 2 x pp 1 x dp 2" in text
    assert [_row(text, r)[1:] for r in (0, 2, 3, 6)] == [["node0/gpu0", "0", "0", "0", "0"],
                                                          ["node0/gpu2", "0", "1", "0", "0"],
                                                          ["node0/gpu3", "1", "1", "0", "0"],
                                                          ["node1/gpu2", "0", "1", "0", "1"]]
    assert "context parallel (ring order): 4 groups of 2, each inside one node; first [0, 2]" in text
    assert "data parallel: 4 groups of 2, spanning nodes; first [0, 4]" in text
    assert "gradients and ZeRO (data x context parallel): 2 groups of 4, spanning nodes; first [0, 2, 4, 6]" in text
    assert "each sequence split over 2 context-parallel ranks, 32 tokens each" in text
    ring_first = load_config(os.path.join(ROOT, "configs/tiny/llama.yaml"),
                             ["parallel.tp=2", "parallel.cp=4", "parallel.order=cp-tp-dp-pp"])
    assert "context parallel (ring order): 4 groups of 4, each inside one node; first [0, 1, 2, 3]" in dry_run(
        ring_first, 16, gpus_per_node=4, gpu="cpu")


def test_expert_parallel_groups(no_collectives):
    """The tiny Mixtral at tp 2 x dp 4 x ep 2 on two 4-GPU nodes: rank = tp + 2 * dp; ep pairs neighbouring dp ranks."""
    cfg = load_config(os.path.join(ROOT, "configs/tiny/mixtral.yaml"), ["parallel.tp=2", "parallel.ep=2"])
    text = dry_run(cfg, 8, gpus_per_node=4, gpu="cpu")
    assert "world 8 = tp 2 x cp 1 x pp 1 x dp 4 (order tp-cp-dp-pp, innermost first; virtual pp 1; ep 2 of dp)" in text
    assert "expert parallel (token all-to-all): 4 groups of 2, each inside one node; first [0, 2]" in text
    assert "expert gradients and ZeRO (expert replicas): 4 groups of 2, spanning nodes; first [0, 4]" in text
    assert "expert parallel" not in dry_run(load_config(os.path.join(ROOT, "configs/tiny/mixtral.yaml")), 8,
                                            gpus_per_node=4, gpu="cpu")


def test_invalid_layout_fails_with_the_key_and_a_fix(capsys):
    cfg = load_config(os.path.join(ROOT, "configs/tiny/gpt.yaml"), ["parallel.tp=4"])
    with pytest.raises(ConfigError) as error:
        dry_run(cfg, 6)
    assert error.value.keys == ["parallel.dp"] and "Fix:" in str(error.value)
    assert dry_run_module.main(["--config", os.path.join(ROOT, "configs/tiny/gpt.yaml"), "--world-size", "6",
                                "parallel.tp=4"]) == 2
    assert "config error: parallel.dp" in capsys.readouterr().err


def test_main_takes_the_world_size_from_the_launcher(monkeypatch, capsys):
    config = os.path.join(ROOT, "configs/tiny/gpt.yaml")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    assert dry_run_module.main(["--config", config]) == 2
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert dry_run_module.main(["--config", config, "--gpu", "cpu", "parallel.pp=2"]) == 0
    assert "world 4 = tp 1 x cp 1 x pp 2 x dp 2" in capsys.readouterr().out


# ----- the launch scripts --------------------------------------------------------------------------
@pytest.fixture
def stubs(tmp_path):
    """A bin directory whose python, sbatch and srun append their arguments to a log instead of running."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in ("python", "sbatch", "srun"):
        stub = bin_dir / name
        stub.write_text("#!/usr/bin/env bash\n"
                        f"{{ printf '%s' \"{name}\"; printf '{SEP}%s' \"$@\"; printf '\\n'; }} >> \"$STUB_LOG\"\n"
                        f"exit \"${{STUB_RC_{name.upper()}:-0}}\"\n")
        stub.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DRY_RUN", "NNODES", "NODE_RANK",
                                                                      "MASTER_", "NPROC", "ENTRY", "GPU"))}
    env = dict(clean, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=str(bin_dir / "python"),
               STUB_LOG=str(log))

    def run(script, *args, **extra):
        result = subprocess.run(["bash", script, *args], cwd=ROOT, env=dict(env, **extra), capture_output=True,
                                text=True, timeout=60)
        calls = [line.split(SEP) for line in log.read_text().splitlines()] if log.exists() else []
        log.unlink(missing_ok=True)
        return result, calls

    return run


def _template(path: str) -> dict:
    text = open(path).read()
    layout = re.search(r"^LAYOUT=\((.*?)\)", text, re.M | re.S).group(1).split()
    return {"config": re.search(r"^CONFIG=(\S+)", text, re.M).group(1),
            "entry": re.search(r"^ENTRY=(\S+)", text, re.M).group(1),
            "nodes": int(re.search(r"^#SBATCH --nodes=(\d+)", text, re.M).group(1)),
            "var_nodes": int(re.search(r"^NODES=(\d+)", text, re.M).group(1)), "layout": layout}


def _run_recorded_dry_run(call: list[str], capsys) -> str:
    assert call[:3] == ["python", "-m", "megatron_domino.training.dry_run"]
    module = importlib.import_module(call[2])
    assert module.main(call[3:]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_six_slurm_templates_exist():
    names = {os.path.basename(p) for p in TEMPLATES}
    assert names == {f"{n}.sbatch" for n in ("gpt3-6.7b", "gpt3-13b", "gpt3-175b", "llama2-7b", "llama2-70b",
                                             "llama3-8b")}


@pytest.mark.parametrize("template", TEMPLATES, ids=os.path.basename)
def test_slurm_template_dry_run_passes_before_submitting(template, stubs, capsys, no_collectives):
    spec = _template(template)
    assert spec["nodes"] == spec["var_nodes"], "#SBATCH --nodes and NODES disagree"
    assert os.path.isfile(os.path.join(ROOT, spec["config"])) and os.path.isfile(os.path.join(ROOT, spec["entry"]))
    result, calls = stubs(template, DRY_RUN_ONLY="1")
    assert result.returncode == 0, result.stderr
    assert len(calls) == 1
    world = str(spec["nodes"] * 8)
    assert calls[0][3:11] == ["--config", spec["config"], "--world-size", world, "--gpus-per-node", "8",
                              "--gpu", "h100-80gb"]
    assert calls[0][11:] == spec["layout"]
    report = _run_recorded_dry_run(calls[0], capsys)
    assert f"{world} ranks" in report and "-> fits" in report


def test_slurm_template_submits_only_after_the_dry_run_and_runs_srun_inside_the_job(stubs):
    template = os.path.join(ROOT, "scripts/slurm/gpt3-175b.sbatch")
    result, calls = stubs(template, "train.steps=5")
    assert result.returncode == 0, result.stderr
    assert [c[0] for c in calls] == ["python", "sbatch"]
    assert calls[1][1:] == ["--nodes=16", "--ntasks-per-node=8", template, "train.steps=5"]
    result, calls = stubs(template, "train.steps=5", SLURM_JOB_ID="4242", SLURM_NTASKS="128", SLURM_NNODES="16",
                          SLURM_SUBMIT_DIR=ROOT)
    assert result.returncode == 0, result.stderr
    assert [c[0] for c in calls] == ["python", "srun"]
    assert calls[0][6] == "128"
    assert calls[1][1] == "--kill-on-bad-exit=1"
    assert calls[1][3:] == ["pretrain_gpt.py", "--config", "configs/gpt/175b.yaml", "train.steps=5"]


def test_a_failing_dry_run_stops_the_launch(stubs):
    result, calls = stubs(os.path.join(ROOT, "scripts/slurm/llama2-70b.sbatch"), STUB_RC_PYTHON="2")
    assert result.returncode == 2 and "launch stopped" in result.stderr
    assert [c[0] for c in calls] == ["python"]


def test_single_node_launcher(stubs):
    result, calls = stubs("scripts/run_single_node.sh", "configs/tiny/llama.yaml", "parallel.tp=2", NPROC="4")
    assert result.returncode == 0, result.stderr
    assert calls[0][3:7] == ["--config", "configs/tiny/llama.yaml", "--world-size", "4"]
    assert calls[1][1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                            "pretrain_llama.py", "--config", "configs/tiny/llama.yaml", "parallel.tp=2"]


def test_multi_node_launcher(stubs):
    result, calls = stubs("scripts/run_multi_node.sh", "configs/gpt/13b.yaml")
    assert result.returncode != 0 and not calls and "NNODES" in result.stderr
    result, calls = stubs("scripts/run_multi_node.sh", "configs/gpt/13b.yaml", NNODES="2", NODE_RANK="1",
                          MASTER_ADDR="node0")
    assert result.returncode == 0, result.stderr
    assert calls[0][6] == "16"
    launch = calls[1][1:]
    assert launch[:2] == ["-m", "torch.distributed.run"]
    for flag, value in (("--nnodes", "2"), ("--node-rank", "1"), ("--nproc-per-node", "8"),
                        ("--rdzv-backend", "c10d"), ("--rdzv-endpoint", "node0:29500")):
        assert launch[launch.index(flag) + 1] == value
    assert launch[-3:] == ["pretrain_gpt.py", "--config", "configs/gpt/13b.yaml"]


def test_scripts_parse_and_set_the_overlap_environment():
    scripts = glob.glob(os.path.join(ROOT, "scripts/*.sh")) + TEMPLATES
    scripts.append(os.path.join(ROOT, "scripts/slurm/launch.sh"))
    for script in scripts:
        assert subprocess.run(["bash", "-n", script], capture_output=True).returncode == 0, script
    env = subprocess.run(["bash", "-c", f"source {ROOT}/scripts/env.sh && env"], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"]}).stdout.splitlines()
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in env and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in env
    if shutil.which("shellcheck"):
        own = [s for s in scripts if os.path.basename(s) not in ("quickstart.sh", "test.sh")]
        check = subprocess.run(["shellcheck", "-x", *own], cwd=ROOT, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout
