"""benchmarks/context_parallel.py: its arithmetic, and one tiny unthrottled run of the three styles (the plumbing:
every style computes attention exactly, and its no-comm twin really skipped every exchange)."""
import json
import os
import subprocess
import sys

import pytest

from tests.training_runs import REPO, environment

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import context_parallel  # noqa: E402

# Exchanges per forward+backward at cp 4: the ring's 3 K/V hops forward, 3 backward and 4 gradient hops; Ulysses'
# 4 all-to-alls each way (per pipelined head slice); a2a+ring (2 x 2) those 8 in its groups and a ring of 2 (1 + 1 +
# 2 hops).
EXCHANGES = {"ring": 10, "a2a": 8, "a2a+ring": 12}


def _rows(style: str, ms: float, no_comm_ms: float, mb: float) -> list[dict]:
    common = {"style": style, "exchanges": EXCHANGES[style], "mb_sent_per_rank": mb, "max_error": 0.0}
    return [dict(common, no_comm=False, median_s=ms / 1e3, samples_s=[ms / 1e3], skipped=0),
            dict(common, no_comm=True, median_s=no_comm_ms / 1e3, samples_s=[no_comm_ms / 1e3],
                 skipped=EXCHANGES[style])]


@pytest.mark.quick
def test_exposed_communication_is_the_gap_to_the_no_comm_twin_and_ratios_are_to_the_ring():
    size = {"seq": 4096, "rows": _rows("ring", 1300, 500, 40) + _rows("a2a", 800, 500, 12)
            + _rows("a2a+ring", 900, 500, 25)}
    summary = context_parallel.summarize(size, "1gbit")
    ring, a2a, hybrid = summary["styles"]
    assert (ring["exposed_ms"], a2a["exposed_ms"], hybrid["exposed_ms"]) == pytest.approx((800, 300, 400))
    assert a2a["exposed_vs_ring"] == pytest.approx(300 / 800) and hybrid["vs_ring"] == pytest.approx(900 / 1300)
    # per step: 500 / 4 ms of compute against 4 ranks x 40 MB over 1 gbit, split over 4 steps
    assert context_parallel.ring_steps(summary, 4) == pytest.approx((125.0, 320.0))
    args = vars(context_parallel.parse_args(["--seqs", "4096"]))
    table = context_parallel.report([{"rate": "1gbit", "args": args, "sizes": [summary]}])
    assert "the ring cannot hide its hops: 125.0 ms compute per step vs 320.0 ms on the wire" in table
    assert "| 1gbit | 4096 | a2a | 800.0 | 500.0 | 300.0 | 0.62 | 0.38 | 12.0 | 8 |" in table
    assert context_parallel.bits_per_second("500mbit") == 5e8 and context_parallel.bits_per_second("none") is None
    with pytest.raises(SystemExit):
        context_parallel.parse_args(["--seqs", "100"])  # not divisible by 2 x cp x a2a size


@pytest.mark.slow
def test_tiny_run_of_the_three_styles(tmp_path):
    """4 ranks on the raw loopback: every style matches one process, its no-comm twin skipped every exchange (and
    so computes something else), and the table has a row per style and size. 8 heads: a2a may pipeline 2 slices
    of 4 (one head per rank each), as many as the library's default allows."""
    path = tmp_path / "context_parallel.json"
    result = subprocess.run([sys.executable, "benchmarks/context_parallel.py", "--seqs", "32,64", "--heads", "8",
                             "--head-dim", "8", "--rounds", "1", "--rates", "none", "--json", str(path)],
                            cwd=REPO, env=environment(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    run = json.loads(path.read_text())["runs"][0]
    slices = max(n for n in range(1, run["args"]["a2a_slices"] + 1) if 8 % (4 * n) == 0)
    exchanges = dict(EXCHANGES, a2a=8 * slices)
    sizes = run["sizes"]
    assert [s["seq"] for s in sizes] == [32, 64]
    for size in sizes:
        assert [s["style"] for s in size["styles"]] == list(EXCHANGES)
        for s in size["styles"]:
            assert s["exchanges"] == exchanges[s["style"]] and s["mb_sent_per_rank"] > 0, s
            assert s["no_comm_exchanges_skipped"] == s["exchanges"] and s["comm_exchanges_skipped"] == 0, s
            assert s["max_error"] < 1e-5 < 1e-2 < s["no_comm_max_error"], s
            assert f"| none | {size['seq']} | {s['style']} |" in result.stdout
