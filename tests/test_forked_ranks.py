"""tests/forked_ranks.py, which most training tests launch through: each rank runs the script as a bare
interpreter would, with torchrun's variables; a failure or a hang ends every rank, and nothing is left running."""
import os
import subprocess
import textwrap
import time

import pytest

from tests.forked_ranks import run

SCRIPT = textwrap.dedent("""
    import atexit, os, sys, time
    import torch
    rank = int(os.environ.get("RANK", "-1"))
    with open(os.path.join(sys.argv[1], f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    atexit.register(lambda: open(os.path.join(sys.argv[1], f"exited{rank}"), "w").close())
    print(f"out {rank} {os.environ.get('WORLD_SIZE')} {os.environ.get('LOCAL_RANK')} {os.getcwd()} "
          f"{torch.get_num_threads()} {os.environ.get('HANDED')} {os.environ.get('PATH', 'unset')} {sys.argv[2:]}")
    print(f"err {rank}", file=sys.stderr)
    if __name__ == "__main__" and rank == int(sys.argv[2]):
        sys.exit(int(sys.argv[3]))
    if __name__ == "__main__" and rank == int(sys.argv[4]):
        time.sleep(3600)
""")


def _launch(tmp_path, nproc, failing=-9, status=0, hanging=-9, timeout=60.0):
    """The environment handed over lacks PATH, which the forkserver has: a rank sees only what it was given."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    return run([str(script), str(tmp_path), str(failing), str(status), str(hanging)], nproc,
               {"OMP_NUM_THREADS": "1", "HANDED": "over"}, str(tmp_path), timeout)


def _none_alive(tmp_path):
    for name in os.listdir(tmp_path):
        if name.startswith("pid"):
            pid = int((tmp_path / name).read_text())
            try:
                with open(f"/proc/{pid}/stat") as f:
                    assert f.read().split(")")[-1].split()[0] == "Z", f"rank {name[3:]} (pid {pid}) still runs"
            except FileNotFoundError:
                pass


def test_every_rank_runs_the_script_as_main_and_its_output_comes_back_in_rank_order(tmp_path):
    result = _launch(tmp_path, 3)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"out {r} 3 {r} {tmp_path} 1 over unset ['-9', '0', '-9']"
                                        for r in range(3)]
    assert result.stderr.splitlines() == [f"err {r}" for r in range(3)]
    assert sorted(os.listdir(tmp_path)) == sorted(["script.py", *(f"{k}{r}" for k in ("pid", "exited")
                                                                   for r in range(3))])
    one = _launch(tmp_path, 1)  # one rank: a bare process, no launcher variables
    assert one.stdout.startswith("out -1 None None "), one.stdout


def test_a_failing_rank_ends_the_others_and_its_status_is_the_runs(tmp_path):
    start = time.monotonic()
    result = _launch(tmp_path, 3, failing=1, status=3, hanging=2)
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert time.monotonic() - start < 20
    assert (tmp_path / "exited1").exists()
    _none_alive(tmp_path)


def test_an_exception_is_status_one_with_its_traceback(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text("raise ValueError('deliberate')\n")
    raised = run([str(script)], 2, {}, str(tmp_path), 60)
    assert raised.returncode == 1 and raised.stderr.count("ValueError: deliberate") == 2, raised


def test_a_hang_raises_timeout_expired_and_leaves_nothing_running(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        _launch(tmp_path, 2, hanging=0, timeout=5)
    _none_alive(tmp_path)
