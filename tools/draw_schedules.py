"""Draw the pipeline schedules and Domino's order as SVG, from the data the executors run, into docs/images/.

The pipeline pictures are each schedule's programs (``pipeline.schedules.build_schedule``) as the simulator times
them (``pipeline.simulate``), so a picture changes when a schedule does; Domino's is the order
``domino.order.forward_order`` / ``backward_order`` give one block. ``tests/test_docs.py`` redraws them and
compares, so a picture cannot drift from the code.

    python tools/draw_schedules.py            # rewrite docs/images/*.svg
    python tools/draw_schedules.py --check    # exit 1 if a picture is not what the code gives
"""
from __future__ import annotations

import argparse
import os
import sys
from html import escape

from megatron_domino.domino.order import backward_order, forward_order
from megatron_domino.pipeline.program import Overlapped
from megatron_domino.pipeline.schedules import build_schedule, get, names, v_shape
from megatron_domino.pipeline.simulate import Costs, simulate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGES = os.path.join(REPO, "docs", "images")
PP, MICROBATCHES = 4, 8
COLOURS = {"forward": ("F", "#4c78a8", "#9ecae9"), "backward": ("B", "#54a24b", "#a1d99b"),
           "backward_input": ("I", "#f58518", "#fdd0a2"), "backward_weight": ("W", "#b279a2", "#dcc3d8")}
UNIT, ROW, LEFT, TOP = 24, 26, 64, 34  # px per unit of time, per rank row; margins
SCALE = 90  # Domino's px per unit of time (a forward phase of one chunk)


def _svg(width: float, height: float, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(body) + "\n</svg>\n")


def _rect(x: float, y: float, w: float, h: float, fill: str, stroke: str = "white") -> str:
    return f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}" stroke="{stroke}"/>'


def _text(x: float, y: float, text: str, anchor: str = "start", size: int = 11) -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-family="sans-serif" font-size="{size}" '
            f'text-anchor="{anchor}">{escape(text)}</text>')


def _legend(y: float, items: list[tuple[str, str]]) -> list[str]:
    body, x = [], LEFT
    for label, fill in items:
        body += [_rect(x, y - 10, 12, 12, fill), _text(x + 16, y, label)]
        x += 24 + 7 * len(label)
    return body


def pipeline_svg(kind: str) -> str:
    """One schedule at pp 4, 8 micro-batches; a chunk's ops cost 1/v of a stage's (F 1, B 2, I and W 1 each)."""
    title, virtual = get(kind).label, get(kind).picture_chunks
    schedule = build_schedule(kind, PP, MICROBATCHES, virtual)
    result = simulate(schedule, MICROBATCHES, virtual, Costs(1.0 / virtual, 2.0 / virtual), v_shape=v_shape(kind))
    heading = (f"{title}: pp {PP}, {MICROBATCHES} micro-batches, {virtual} chunk(s) per rank; bubble "
               f"{result.bubble_fraction:.1%} (grey), peak in flight {max(result.max_in_flight)} chunk-micro-batches")
    width = max(LEFT + result.makespan * UNIT, LEFT + 6.8 * len(heading)) + 16
    body = [_text(LEFT, 18, heading, size=12)]
    for rank, row in enumerate(result.spans):
        y = TOP + rank * ROW
        body += [_text(8, y + 16, f"rank {rank}"), _rect(LEFT, y, result.makespan * UNIT, ROW - 4, "#f4f4f4")]
        for span in row:
            letter, dark, light = COLOURS[span.instruction.op]
            x, w = LEFT + span.start * UNIT, (span.end - span.start) * UNIT
            body += [_rect(x, y, w, ROW - 4, dark if span.instruction.chunk == 0 else light),
                     _text(x + w / 2, y + 15, (letter if w >= 20 else "") + str(span.instruction.microbatch),
                           "middle", 10)]
        for unit in (s for s in schedule[rank] if isinstance(s, Overlapped)):
            spans = [s for s in row if s.instruction in unit.halves]
            start, end = min(s.start for s in spans), max(s.end for s in spans)
            body.append(f'<rect x="{LEFT + start * UNIT:.1f}" y="{y:.1f}" width="{(end - start) * UNIT:.1f}" '
                        f'height="{ROW - 4}" fill="none" stroke="black" stroke-width="1.5"/>')
    used = {span.instruction.op for row in result.spans for span in row}
    legend = [(f"{letter} {name}", dark) for op, name in zip(COLOURS, ("forward", "backward", "input gradient",
                                                                    "weight gradient"))
              if op in used for letter, dark, _ in [COLOURS[op]]]
    if virtual > 1:
        legend.append(("lighter: chunk 1", "#dddddd"))
    if any(isinstance(s, Overlapped) for program in schedule for s in program):
        legend.append(("outlined: F&B unit", "white"))
    body += _legend(TOP + PP * ROW + 16, legend)
    return _svg(width, TOP + PP * ROW + 30, body)


def _lanes(steps: list[tuple], reduce_cost: float) -> tuple[list, list, float]:
    """Time steps on one compute lane and one communication lane. ('run', X, cost, R) computes X, then starts
    all-reduce R (none when R is None) once the link is free; ('wait', R) holds the compute lane until R is done."""
    compute, comm, done, t, link = [], [], {}, 0.0, 0.0
    for step in steps:
        if step[0] == "wait":
            t = max(t, done[step[1]])
            continue
        _, name, cost, reduce = step
        compute.append((t, t + cost, name))
        t += cost
        if reduce is not None:
            start = max(t, link)
            link = start + reduce_cost
            comm.append((start, link, reduce))
            done[reduce] = link
    return compute, comm, t


def domino_steps() -> tuple[list, list]:
    """Forward and backward of one block, two mu-chunks, as lane steps: the order's data, relabelled."""
    order = forward_order(1, 2, "inter")
    forward = [("run", s.label()[:-1], 1.0, s.label()[:-1]) if s.op == "launch" else ("wait", s.label())
               for s in order]
    labels = backward_order(order, 2)
    backward = [("wait", label) if label.startswith("~") else
                ("run", label[:-1], 2.0, "~" + label[:-1] if "~" + label[:-1] in labels else None)
                for label in labels]
    return forward, backward


def _lane_label(name: str) -> str:
    phase = {"A": "attention", "M": "MLP"}[name.lstrip("~")[0]]
    return f"{phase} \u03bc{name.split('.')[-1]}"


def domino_svg() -> str:
    """One block (attention, MLP) at tp > 1, two mu-chunks: the compute and the all-reduces it hides."""
    forward, backward = domino_steps()
    lanes = [("forward", *_lanes(forward, 0.8)), ("backward", *_lanes(backward, 0.8))]
    span = max(end for _, _, _, end in lanes)
    heading = ("Domino: one block at tp > 1, split into 2 \u03bc-chunks (parallel.domino_split=row); each "
               "all-reduce flies while the other chunk computes")
    body = [_text(8, 18, heading, size=12)]
    notes = {"forward": "the last chunk's MLP all-reduce: with domino_overlap=inter it hides behind the next "
                        "block's first attention",
             "backward": "a computation starts its input gradient's all-reduce, waited for after the other "
                         "chunk's next computation"}
    y = TOP + 8
    for title, compute, comm, _ in lanes:
        body.append(_text(8, y - 6, f"{title}: {notes[title]}", size=11))
        for lane, boxes, fill in (("compute", compute, "#4c78a8"), ("all-reduce", comm, "#f58518")):
            body += [_text(8, y + 16, lane), _rect(LEFT + 16, y, span * SCALE, ROW - 4, "#f4f4f4")]
            for start, stop, name in boxes:
                x, w = LEFT + 16 + start * SCALE, (stop - start) * SCALE
                body += [_rect(x, y, w, ROW - 4, fill), _text(x + w / 2, y + 15, _lane_label(name), "middle", 10)]
            y += ROW
        y += 24
    return _svg(max(LEFT + 32 + span * SCALE, 24 + 6.8 * len(heading)), y - 12, body)


def pictures() -> dict[str, str]:
    """File name under docs/images -> SVG text."""
    drawn = {f"pipeline-{kind}.svg": pipeline_svg(kind) for kind in names()}
    drawn["domino-block.svg"] = domino_svg()
    return drawn


def _read(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/images instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for name, text in pictures().items():
        path = os.path.join(IMAGES, name)
        if args.check:
            if _read(path) != text:
                stale.append(name)
            continue
        os.makedirs(IMAGES, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    if stale:
        print("stale pictures (run python tools/draw_schedules.py): " + ", ".join(stale), file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
