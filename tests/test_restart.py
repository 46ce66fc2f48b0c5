"""Later attempts of a job: torchrun's in-job restarts (--max-restarts) and slurm's requeue.

A restarted attempt starts its process groups in a store namespace of its own (over torchrun's store, which
keeps the dead attempt's keys), takes over the dead attempt's lock on checkpoint.dir at once, resumes from
``latest`` by itself and ends bit for bit where an uninterrupted run ends. None of these runs sets
TORCH_DISABLE_SHARE_RDZV_TCP_STORE: the point is that no user has to know it.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_domino import checkpoint_format as fmt
from megatron_domino.config import load_config
from megatron_domino.config.errors import CheckpointError
from megatron_domino.parallel import attempt as attempt_module
from megatron_domino.parallel.attempt import Attempt, open_store
from megatron_domino.parallel.launch import free_port
from megatron_domino.training.checkpoint_dir import JOB, LOCK, acquire_lock, prepare_run_dirs
from tests.test_training import assert_bitwise_resume
from tests.training_runs import COMMON, REPO, TINY, environment, kill_group, metrics, wait_for_step, worker_pids

RUN = ["parallel.pp=2", "train.steps=12", "checkpoint.interval=3", "checkpoint.keep=0"]  # 2 ranks, one per stage
JOB_ID = "torchrun:0123"


def _no_launcher(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_")):
            monkeypatch.delenv(name)
    monkeypatch.setattr(attempt_module, "_current", Attempt())
    monkeypatch.setattr(attempt_module, "_agreed", False)


# ----- the store namespace of an attempt ------------------------------------------------------------
def _start_attempt(world: int, new_processes: bool = True) -> list:
    """Every rank's ``open_store`` of one attempt, on threads: [(store, attempt)] by rank. ``new_processes``
    False: the ranks of the previous call start their groups again (a re-init in the same processes)."""
    out = [None] * world
    if new_processes:
        attempt_module._agreed = False

    def rank_main(rank):
        store = open_store(rank, world, timedelta(seconds=30))
        out[rank] = (store, attempt_module.current_attempt())

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(out), "an attempt's ranks did not agree on a namespace"
    return out


def test_each_attempt_gets_a_namespace_of_its_own_over_torchruns_store(monkeypatch):
    _no_launcher(monkeypatch)
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    first = _start_attempt(3)
    assert {a for _, a in first} == {first[0][1]} and first[0][1].restarts == 0
    first[0][0].set("rank_0", "address of a rank that is about to die")
    server.append("megatron_domino/attempts/hello", "a-token-whose-rank-died-before-its-reply,")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # what one node's agent says; the others may say 0
    second = _start_attempt(3)
    attempts = {a for _, a in second}
    assert len(attempts) == 1 and second[0][1].restarts == 1 and second[0][1].number == 1
    assert second[0][1].job == first[0][1].job and second[0][1].job.startswith("torchrun:")
    assert not second[1][0].check(["rank_0"])  # the dead attempt's keys are out of sight
    assert not server.check(["megatron_domino/attempts/hello"])  # the handshake cleans up after itself
    second[0][0].set("rank_0", "address of this attempt's first process group")
    again = _start_attempt(3, new_processes=False)  # a program that starts its groups twice is not restarted
    assert {a for _, a in again} == attempts and not again[2][0].check(["rank_0"])


def test_slurm_names_the_job_and_counts_its_requeues(monkeypatch):
    _no_launcher(monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    found = attempt_module._attempt_here(0, None)
    assert found == Attempt("slurm::4242", requeues=2) and found.describe() == "slurm requeue 2"


# ----- the lock and the resume decision -----------------------------------------------------------------
def _lock_of(root, **fields) -> None:
    record = {"host": "another-host", "pid": 1, "run_id": "dead", "started": "earlier", "job": JOB_ID,
              "attempt": [0, 0], **fields}
    with open(os.path.join(root, LOCK), "w") as f:
        json.dump(record, f)


def test_an_earlier_attempt_of_this_job_loses_its_lock_at_once(tmp_path):
    root = str(tmp_path)
    _lock_of(root)  # on another host, heartbeat fresh: only the job and attempt tell it is over
    with pytest.warns(UserWarning, match=r"taking over the lock .* it was taken by an earlier attempt of this job "
                                         r"\(torchrun:0123\), which has ended; this is restart attempt 1"):
        acquire_lock(root, "new", Attempt(JOB_ID, restarts=1)).release()
    refused = {"another job": ({"job": "torchrun:other"}, Attempt(JOB_ID, restarts=1)),
               "the same attempt": ({}, Attempt(JOB_ID)),
               "no job": ({"job": None}, Attempt(None, restarts=1)),
               "alive here": ({"host": os.uname().nodename, "pid": os.getpid()}, Attempt(JOB_ID, restarts=1))}
    for case, (fields, attempt) in refused.items():
        _lock_of(root, **fields)
        with pytest.raises(CheckpointError, match="is in use by the run of pid"):
            acquire_lock(root, "new", attempt)
        assert json.load(open(os.path.join(root, LOCK)))["run_id"] == "dead", case


def test_a_restart_resumes_only_in_a_folder_its_own_job_accepted(tmp_path):
    root = str(tmp_path / "checkpoints")
    cfg = load_config(os.path.join(REPO, TINY["gpt"]), [f"checkpoint.dir={root}", f"log.dir={tmp_path}/log"])
    first = prepare_run_dirs(cfg, 0, "k", attempt=Attempt(JOB_ID))
    first.lock.release()
    assert not first.resume and json.load(open(os.path.join(root, JOB)))["job"] == JOB_ID
    with open(os.path.join(root, fmt.LATEST), "w") as f:
        f.write('{"step": 3, "dir": "step_00000003"}')
    again = prepare_run_dirs(cfg, 0, "k", attempt=Attempt(JOB_ID, restarts=1))  # checkpoint.load is not set
    again.lock.release()
    assert again.resume
    for stranger in (Attempt(JOB_ID), Attempt("torchrun:other", restarts=1), Attempt(None)):
        with pytest.raises(CheckpointError, match="already holds checkpoints"):
            prepare_run_dirs(cfg, 0, "k", attempt=stranger)


# ----- slurm's batch script: the warning signal, the save and the requeue ----------------------------------
FAKE_SRUN = r"""#!/usr/bin/env bash
# Stands in for srun: SLURM_NTASKS tasks of "$@" (or of $FAKE_TASK) with SLURM_PROCID and SLURM_LOCALID set,
# signals forwarded to them, the worst status returned.
echo "srun $*" >> "$FAKE_LOG"
while [[ $1 == --* ]]; do shift; done
if [[ -n ${FAKE_TASK:-} ]]; then set -- bash -c "$FAKE_TASK"; fi
pids=()
for ((task = 0; task < SLURM_NTASKS; task++)); do
  SLURM_PROCID=$task SLURM_LOCALID=$task "$@" &
  pids+=($!)
done
trap 'kill -USR1 "${pids[@]}" 2>/dev/null' USR1
worst=0
for pid in "${pids[@]}"; do
  while :; do
    if wait "$pid"; then status=0; else status=$?; fi
    kill -0 "$pid" 2>/dev/null || break
  done
  if (( status > worst )); then worst=$status; fi
done
exit "$worst"
"""
TEMPLATE = """#!/usr/bin/env bash
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
set -euo pipefail
CONFIG=configs/tiny/gpt.yaml
ENTRY=pretrain_gpt.py
NODES=1
LAYOUT=(parallel.pp=2)
source "$SLURM_SUBMIT_DIR/scripts/slurm/launch.sh"
"""
# A task that waits for the signal as a rank does and then exits with $TASK_STATUS, or ends on its own at $STOP.
STAND_IN = ('trap "exit $TASK_STATUS" USR1; touch "$READY/$SLURM_PROCID"; '
            'while [[ ! -e $STOP ]]; do sleep 0.05; done')


@pytest.fixture
def slurm_job(tmp_path):
    """Runs a 2-task tiny-GPT template as slurm would inside job 4242, with srun and scontrol faked on PATH."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\necho "scontrol $*" >> "$FAKE_LOG"\n')
    for name in ("srun", "scontrol"):
        (bin_dir / name).chmod(0o755)
    template = tmp_path / "tiny.sbatch"
    template.write_text(TEMPLATE)
    env = dict(environment(), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable,
               FAKE_LOG=str(log), SLURM_JOB_ID="4242", SLURM_NTASKS="2", SLURM_NNODES="1", SLURM_SUBMIT_DIR=REPO,
               GPUS_PER_NODE="2", MASTER_ADDR="127.0.0.1")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)

    def start(args, output, **extra) -> subprocess.Popen:
        return subprocess.Popen(["bash", str(template), *args], cwd=REPO, stdout=open(output, "w"),
                                env=dict(env, MASTER_PORT=str(free_port()), **extra), stderr=subprocess.STDOUT,
                                start_new_session=True)
    start.calls = lambda: log.read_text().splitlines() if log.exists() else []
    return start


def finish(proc: subprocess.Popen, output, timeout: float = 120) -> tuple[int, str]:
    try:
        status = proc.wait(timeout=timeout)
    finally:
        kill_group(proc)
    return status, open(output).read()


@pytest.mark.parametrize("signalled, task_status, requeued", [(True, 0, True), (False, 0, False), (True, 3, False)],
                         ids=["signal-then-saved", "no-signal", "signal-then-failed"])
def test_the_batch_script_forwards_the_warning_and_requeues_after_a_save(slurm_job, tmp_path, signalled,
                                                                          task_status, requeued):
    ready, stop, output = tmp_path / "ready", tmp_path / "stop", tmp_path / "out.txt"
    ready.mkdir()
    proc = slurm_job(COMMON, output, FAKE_TASK=STAND_IN, READY=str(ready), STOP=str(stop),
                     TASK_STATUS=str(task_status), PYTHON="true")  # no dry run: tests/test_dry_run.py has them
    deadline = time.monotonic() + 60
    while len(os.listdir(ready)) < 2:  # both tasks wait for the signal
        assert proc.poll() is None and time.monotonic() < deadline, open(output).read()
        time.sleep(0.05)
    if signalled:
        os.kill(proc.pid, signal.SIGUSR1)  # what --signal=B:USR1 does: the batch shell, not the tasks
    else:
        stop.touch()  # the run ends by itself
    status, text = finish(proc, output)
    calls = slurm_job.calls()
    assert calls[0].startswith("srun --kill-on-bad-exit=1 "), calls
    assert (calls[1:] == ["scontrol requeue 4242"]) == requeued, (calls, text)
    assert status == task_status, text
    assert ("requeueing job 4242" in text) == requeued and ("is not requeued" in text) == (task_status != 0)


@pytest.mark.slow
def test_slurms_warning_saves_requeues_and_the_requeued_job_resumes_bitwise(slurm_job, reference, tmp_path):
    run = str(tmp_path / "run")
    args = [*COMMON, f"log.dir={run}", f"checkpoint.dir={run}/checkpoints", *RUN[1:]]
    first = slurm_job(args, tmp_path / "first.txt")
    wait_for_step(run, 3, first)
    os.kill(first.pid, signal.SIGUSR1)  # --signal=B:USR1: the batch shell, not the ranks
    status, text = finish(first, tmp_path / "first.txt")
    assert status == 0 and "preemption signal received: saving at step" in text, text[-4000:]
    assert slurm_job.calls()[1:] == ["scontrol requeue 4242"], slurm_job.calls()
    saved = json.load(open(os.path.join(run, "checkpoints", fmt.LATEST)))["step"]
    assert 3 <= saved < 12
    status, text = finish(slurm_job(args, tmp_path / "again.txt", SLURM_RESTART_COUNT="1"), tmp_path / "again.txt")
    assert status == 0, text[-4000:]
    assert f"restart attempt 1: resuming from step {saved} (slurm requeue 1)" in text, text[-4000:]
    assert slurm_job.calls()[2:] == [slurm_job.calls()[0]]  # srun again, and no second requeue
    assert_equal_to(reference, run)


# ----- torchrun --max-restarts ------------------------------------------------------------------------------
def torchrun_job(run: str, nodes: int, port: int, log_path, ranks: int = 2, overrides=()) -> subprocess.Popen:
    """One torchrun agent of a ``nodes``-node job (``ranks`` in all) on this host, c10d rendezvous, one restart
    allowed; ``overrides`` come after RUN's."""
    per_node = ranks // nodes
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={per_node}",
               "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=job",
               "--monitor-interval=0.5", os.path.join(REPO, "pretrain_gpt.py"), "--config",
               os.path.join(REPO, TINY["gpt"]), *COMMON, f"log.dir={run}", f"checkpoint.dir={run}/checkpoints", *RUN,
               *overrides]
    env = environment()
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run."""
    run = str(tmp_path_factory.mktemp("reference") / "run")
    status, text = finish(torchrun_job(run, 1, free_port(), run + ".txt"), run + ".txt")
    assert status == 0, text[-4000:]
    return run


def _rank_of(pid: int) -> int:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return int(dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)[b"RANK"])


def assert_equal_to(reference: str, run: str) -> None:
    """Every step the run logged (both attempts') has the reference's loss, each step once in metrics.jsonl (the
    dead attempt's records past the checkpoint set aside), and the final weights and optimizer state are the
    reference's, bit for bit."""
    expected = {r["step"]: r["loss"] for r in metrics(reference)}
    assert [r["step"] for r in metrics(run)] == list(expected), [r["step"] for r in metrics(run)]
    assert all(r["loss"] == expected[r["step"]] for r in metrics(run)), (metrics(run), expected)
    assert_bitwise_resume(reference, run, range(1, 13))


@pytest.mark.slow
@pytest.mark.parametrize("nodes, victim", [(1, 0), (2, 1)], ids=["one-node-lock-holder", "two-nodes"])
def test_a_killed_rank_restarts_in_the_job_and_ends_bitwise(reference, tmp_path, nodes, victim):
    """Two agents give two nodes whose restart counts differ after the restart (each agent counts its own)."""
    run, port = str(tmp_path / "run"), free_port()
    agents = [torchrun_job(run, nodes, port, tmp_path / f"node{n}.txt") for n in range(nodes)]
    try:
        wait_for_step(run, 5, agents[0])
        ranks = {_rank_of(pid): pid for agent in agents for pid in worker_pids(agent.pid)}
        os.kill(ranks[victim], signal.SIGKILL)  # in the first attempt only
        statuses = [agent.wait(timeout=120) for agent in agents]
    finally:
        for agent in agents:
            kill_group(agent)
    text = "".join(open(tmp_path / f"node{n}.txt").read() for n in range(nodes))
    assert statuses == [0] * nodes, text[-4000:]
    resumed = [line for line in text.splitlines() if line.startswith("restart attempt 1: resuming from step ")]
    assert len(resumed) == 1 and "(torchrun restart 1)" in resumed[0], text[-4000:]
    assert int(resumed[0].split()[6]) in (3, 6, 9), resumed
    if victim == 0:  # the lock holder died: its lock is taken over at once, without the 15-minute wait
        assert "it was taken by an earlier attempt of this job" in text, text[-4000:]
    assert_equal_to(reference, run)
