"""tools/plot_metrics.py: two runs into one PNG of the requested size; panels without data are left out and named
with the reason; validation sets get a line each; bad inputs exit 2 with a clear message."""
import json
import os
import struct

import pytest

from tests.tools import load_tool

pytest.importorskip("matplotlib")
plot_metrics = load_tool("plot_metrics")


def _write_run(folder, scale):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step in range(1, 6):
            f.write(json.dumps({"step": step, "loss": scale * 5 / step, "lr": 1e-3 * step, "grad_norm": 1.0 / step,
                                "tokens_per_s": 1000.0 * scale, "mfu": 0.1 * scale}) + "\n")
        f.write(json.dumps({"step": 5, "split": "valid", "loss": scale * 1.5, "ppl": 4.0}) + "\n")
        f.write('{"step": 6, "loss"')  # a line torn by a run still writing
    return os.path.join(folder, "metrics.jsonl")


def test_two_runs_make_one_png_of_the_requested_size(tmp_path, capsys):
    first, second = _write_run(tmp_path / "run-a", 1.0), _write_run(tmp_path / "run-b", 2.0)
    output = str(tmp_path / "plot.png")
    assert plot_metrics.main([first, str(tmp_path / "run-b"), "-o", output, "--width", "6", "--height", "4",
                              "--dpi", "50"]) == 0
    with open(output, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(output) > 1000
    assert struct.unpack(">II", header[16:24]) == (300, 200)
    assert "2 runs" in capsys.readouterr().out
    assert plot_metrics.series(plot_metrics.read_records(second), "loss", "valid") == ([5], [3.0])


def test_missing_or_empty_input_exits_2_naming_it(tmp_path, capsys):
    missing = str(tmp_path / "nope" / "metrics.jsonl")
    assert plot_metrics.main([missing, "-o", str(tmp_path / "x.png")]) == 2
    assert f"{missing}: not found" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert plot_metrics.main([str(empty), "-o", str(tmp_path / "x.png")]) == 2
    assert "no metrics records" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.png")


def test_panels_without_data_are_left_out_with_the_reason_and_each_set_has_its_line(tmp_path, capsys):
    """A CPU run (no MFU) that evaluated its split and one eval.path set: 5 panels, MFU named as missing."""
    os.makedirs(tmp_path / "cpu")
    with open(tmp_path / "cpu" / "metrics.jsonl", "w") as f:
        for step in range(1, 4):
            f.write(json.dumps({"step": step, "loss": 5.0 / step, "lr": 1e-3, "grad_norm": 1.0,
                                "tokens_per_s": 10.0}) + "\n")
        f.write(json.dumps({"step": 3, "split": "valid", "loss": 2.0}) + "\n")
        f.write(json.dumps({"step": 3, "split": "valid", "set": "wiki", "loss": 3.0}) + "\n")
    runs = {"cpu": plot_metrics.read_records(str(tmp_path / "cpu"))}
    drawn, left_out = plot_metrics.panels(runs)
    assert [title for title, _, _ in drawn] == ["loss", "valid loss", "learning rate", "grad norm", "tokens/s"]
    assert [(label, values) for label, _, values in drawn[1][2]] == [("cpu", [2.0]), ("cpu: wiki", [3.0])]
    assert left_out == ["MFU: the device's peak FLOP/s is unknown (a CPU; set log.peak_tflops to have one)"]
    assert plot_metrics.main([str(tmp_path / "cpu"), "-o", str(tmp_path / "p.png")]) == 0
    assert "not drawn: MFU: the device's peak FLOP/s is unknown" in capsys.readouterr().out
