"""Print a pipeline schedule's per-rank timeline and bubble, to review a layout before spending GPUs on it.

    python -m megatron_domino.pipeline.print_schedule --pp 4 --microbatches 8 [--virtual 2] [--kind 1f1b]
"""
from __future__ import annotations

import argparse
import sys

from .schedules import KINDS, build_schedule, schedule_kind
from .simulate import Costs, ScheduleError, simulate
from .timeline import render_timeline, summarize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks (parallel.pp)")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    parser.add_argument("--virtual", type=int, default=1, help="model chunks per rank (parallel.virtual_pp)")
    parser.add_argument("--kind", choices=KINDS, default=None,
                        help="default: none for pp 1, interleaved for virtual > 1, else 1f1b")
    parser.add_argument("--forward-cost", type=float, default=1.0, help="time of one chunk's forward")
    parser.add_argument("--backward-cost", type=float, default=2.0, help="time of one chunk's backward")
    parser.add_argument("--comm-cost", type=float, default=0.0, help="latency of one p2p transfer")
    parser.add_argument("--ops", action="store_true", help="also print every rank's instruction list")
    args = parser.parse_args(argv)
    kind = args.kind or schedule_kind(args.pp, args.virtual)
    try:
        schedule = build_schedule(kind, args.pp, args.microbatches, args.virtual)
        result = simulate(schedule, args.microbatches, args.virtual,
                          Costs(args.forward_cost, args.backward_cost, args.comm_cost))
    except (ValueError, ScheduleError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{kind}: pp={args.pp} microbatches={args.microbatches} virtual_pp={args.virtual} "
          f"forward={args.forward_cost:g} backward={args.backward_cost:g} comm={args.comm_cost:g}")
    print(render_timeline(result))
    print(summarize(result))
    if args.ops:
        for rank, program in enumerate(schedule):
            print(f"rank {rank} ops: " + " ".join(inst.label(args.virtual > 1) for inst in program))
    return 0


if __name__ == "__main__":
    sys.exit(main())
