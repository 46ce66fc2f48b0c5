"""Plot one or more runs' metrics.jsonl against step into one PNG, so runs can be compared at a glance.

    python tools/plot_metrics.py runs/tiny-gpt/metrics.jsonl [runs/other/metrics.jsonl ...] --output plot.png

Panels: train and valid loss (one line per ``eval.path`` set too), learning rate, grad norm, tokens/s, MFU. One
line per run, labelled by the folder that holds its metrics.jsonl (a run folder may be given instead of the file).
Only panels with data are drawn; the others are named with the reason (e.g. no MFU on a CPU, whose peak is
unknown). Exit status 2 when an input is missing or holds no record (nothing would be plotted).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# (title, record key, split): split None is a training record, "valid" a validation one.
PANELS = [("loss", "loss", None), ("valid loss", "loss", "valid"), ("learning rate", "lr", None),
          ("grad norm", "grad_norm", None), ("tokens/s", "tokens_per_s", None), ("MFU", "mfu", None)]
# Why a panel can be empty, for the note that replaces it.
EMPTY = {"valid loss": "the run never evaluated (set train.eval_interval=N)",
         "MFU": "the device's peak FLOP/s is unknown (a CPU; set log.peak_tflops to have one)"}


class InputError(Exception):
    """A metrics file that cannot be plotted: the message says which and why."""


def read_records(path: str) -> list[dict]:
    """The records of one metrics.jsonl (or of RUN_DIR/metrics.jsonl); a torn last line is skipped."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        raise InputError(f"{path}: not found (give a metrics.jsonl or the run folder that holds it)")
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written while we read
            if isinstance(record, dict) and "step" in record:
                records.append(record)
    if not records:
        raise InputError(f"{path}: no metrics records (a record is a JSON line with a 'step'); "
                         "has the run logged its first step yet?")
    return records


def run_label(path: str) -> str:
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    return os.path.basename(os.path.normpath(folder)) or folder


def series(records: list[dict], key: str, split: str | None, eval_set: str | None = None) -> tuple[list, list]:
    """(steps, values) of ``key`` in the records of ``split`` (and of one ``eval.path`` set, if named); a resumed
    run's repeated steps keep the last."""
    points = {r["step"]: r[key] for r in records
              if r.get("split") == split and r.get("set") == eval_set and r.get(key) is not None}
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def lines(runs: dict[str, list[dict]], key: str, split: str | None) -> list[tuple[str, list, list]]:
    """(label, steps, values) of each run's series for a panel: validation has one per set (the data's split
    first, then each ``eval.path`` set)."""
    found = []
    for label, records in runs.items():
        sets = [None] + sorted({r["set"] for r in records if split and r.get("split") == split and "set" in r})
        for eval_set in sets:
            steps, values = series(records, key, split, eval_set)
            if steps:
                found.append((label if eval_set is None else f"{label}: {eval_set}", steps, values))
    return found


def panels(runs: dict[str, list[dict]]) -> tuple[list, list[str]]:
    """([(title, split, lines)] of the panels with data, [why each other panel is left out])."""
    drawn, left_out = [], []
    for title, key, split in PANELS:
        found = lines(runs, key, split)
        if found:
            drawn.append((title, split, found))
        else:
            left_out.append(f"{title}: {EMPTY.get(title, f'no {key!r} in the records')}")
    return drawn, left_out


def plot(runs: dict[str, list[dict]], output: str, width: float = 12.0, height: float = 8.0,
         dpi: int = 100) -> list[str]:
    """Draw the panels with data into ``output``; returns why each other panel was left out."""
    try:
        import matplotlib
    except ImportError:
        raise InputError("matplotlib is not installed: pip install matplotlib (or pip install -e .[test])") from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    drawn, left_out = panels(runs)
    if not drawn:
        raise InputError("no panel has data: " + "; ".join(left_out))
    columns = min(3, len(drawn))
    rows = -(-len(drawn) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(width, height), dpi=dpi, squeeze=False)
    for axis, (title, split, found) in zip(axes.flat, drawn):
        for label, steps, values in found:
            axis.plot(steps, values, label=label, marker="o" if split else None, markersize=3)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        if title.endswith("loss"):
            axis.legend(fontsize="small")
    for axis in list(axes.flat)[len(drawn):]:
        axis.set_visible(False)
    if left_out:
        figure.text(0.01, 0.005, "not drawn: " + "; ".join(left_out), fontsize="small", alpha=0.7)
    figure.tight_layout(rect=(0, 0.03 if left_out else 0, 1, 1))
    figure.savefig(output)
    plt.close(figure)
    return left_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="metrics.jsonl files or run folders")
    parser.add_argument("--output", "-o", default="metrics.png", help="PNG to write (default: metrics.png)")
    parser.add_argument("--width", type=float, default=12.0, help="inches")
    parser.add_argument("--height", type=float, default=8.0, help="inches")
    parser.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args(argv)
    try:
        runs = {}
        for path in args.inputs:
            label = run_label(path)
            runs[label if label not in runs else path] = read_records(path)
        left_out = plot(runs, args.output, args.width, args.height, args.dpi)
    except InputError as error:
        print(f"plot_metrics: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    for reason in left_out:
        print(f"  not drawn: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
