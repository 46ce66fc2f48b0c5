"""A dead rank brings the whole job down within the timeout, and the logs say who died and who waited where."""
import os
import signal
import time

import pytest

from tests.training_runs import kill_group, start_ranks, wait_for_step

pytestmark = pytest.mark.slow  # multi-rank training runs: the whole suite, not -m quick

TIMEOUT_S = 20


def test_killed_rank_every_rank_exits_and_names_the_dead_peer(tmp_path):
    run, logs = str(tmp_path / "run"), str(tmp_path / "logs")
    procs = start_ranks("gpt", 8, run, ["train.steps=1000", "parallel.tp=2", "parallel.pp=2", "parallel.dp=2",
                                        f"parallel.timeout_s={TIMEOUT_S}", "checkpoint.save_at_end=false"], logs)
    try:
        wait_for_step(run, 3, procs[0])
        os.kill(procs[5].pid, signal.SIGKILL)  # rank 5 = (tp 1, pp 1, dp 0) under the tp-cp-dp-pp order
        killed_at = time.monotonic()
        for proc in procs:
            proc.wait(timeout=TIMEOUT_S + 15)
        elapsed = time.monotonic() - killed_at
    finally:
        for proc in procs:
            kill_group(proc)
    assert elapsed <= TIMEOUT_S + 10, elapsed
    assert all(proc.returncode != 0 for proc in procs)
    text = "".join(open(os.path.join(logs, f"rank{r}.log")).read() for r in range(8) if r != 5)
    assert "rank 5 (tp 1, pp 1, dp 0)" in text, text[-5000:]
    assert "while in: step" in text or "no progress" in text, text[-5000:]
    assert text.count("Traceback") <= 1, text[-5000:]  # no rank drowns the log in copies of a peer's failure
