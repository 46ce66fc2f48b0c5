"""Plot one or more runs' metrics.jsonl against step into one PNG, so runs can be compared at a glance.

    python tools/plot_metrics.py runs/tiny-gpt/metrics.jsonl [runs/other/metrics.jsonl ...] --output plot.png

Panels: train and valid loss, learning rate, grad norm, tokens/s, MFU. One line per run, labelled by
the folder that holds its metrics.jsonl (a run folder may be given instead of the file). Exit status 2
when an input is missing or holds no record (nothing would be plotted).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# (title, record key, split): split None is a training record, "valid" a validation one.
PANELS = [("loss", "loss", None), ("valid loss", "loss", "valid"), ("learning rate", "lr", None),
          ("grad norm", "grad_norm", None), ("tokens/s", "tokens_per_s", None), ("MFU", "mfu", None)]


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


def series(records: list[dict], key: str, split: str | None) -> tuple[list, list]:
    """(steps, values) of ``key`` in the records of ``split``; a resumed run's repeated steps keep the last."""
    points = {r["step"]: r[key] for r in records if r.get("split") == split and r.get(key) is not None}
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def plot(runs: dict[str, list[dict]], output: str, width: float = 12.0, height: float = 8.0, dpi: int = 100) -> None:
    try:
        import matplotlib
    except ImportError:
        raise InputError("matplotlib is not installed: pip install matplotlib (or pip install -e .[test])") from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 3, figsize=(width, height), dpi=dpi)
    for axis, (title, key, split) in zip(axes.flat, PANELS):
        for label, records in runs.items():
            steps, values = series(records, key, split)
            if steps:
                axis.plot(steps, values, label=label, marker="o" if split else None, markersize=3)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        if key == "loss" and axis.has_data():
            axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(output)
    plt.close(figure)


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
        plot(runs, args.output, args.width, args.height, args.dpi)
    except InputError as error:
        print(f"plot_metrics: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
