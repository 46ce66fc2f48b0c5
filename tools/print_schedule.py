"""Print a pipeline schedule's per-rank timeline and bubble, to review a layout before spending GPUs on it.

    python tools/print_schedule.py --pp 4 --microbatches 8 [--virtual 2] [--kind 1f1b] [--ops]

(``pretrain_gpt.py CONFIG --print-schedule`` prints the schedule a run's own config executes.)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_domino.pipeline.schedules import build_schedule, implied_chunks, names, schedule_kind  # noqa: E402
from megatron_domino.pipeline.simulate import Costs  # noqa: E402
from megatron_domino.pipeline.timeline import show  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks (parallel.pp)")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    parser.add_argument("--virtual", type=int, default=None,
                        help="model chunks per rank (parallel.virtual_pp); default 1, or what --kind implies (a V: 2)")
    parser.add_argument("--kind", choices=("none", *names()), default=None,
                        help="default: none for pp 1, interleaved for virtual > 1, else 1f1b")
    parser.add_argument("--forward-cost", type=float, default=1.0, help="time of one chunk's forward")
    parser.add_argument("--backward-cost", type=float, default=2.0, help="time of one chunk's backward")
    parser.add_argument("--comm-cost", type=float, default=0.0, help="latency of one p2p transfer")
    parser.add_argument("--ops", action="store_true", help="also print every rank's instruction list")
    args = parser.parse_args(argv)
    if args.virtual is None:
        args.virtual = implied_chunks(args.kind) or 1
    kind = args.kind or schedule_kind(args.pp, args.virtual)
    try:
        schedule = build_schedule(kind, args.pp, args.microbatches, args.virtual)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return show(kind, schedule, args.microbatches, args.virtual,
                Costs(args.forward_cost, args.backward_cost, args.comm_cost), args.ops)


if __name__ == "__main__":
    sys.exit(main())
