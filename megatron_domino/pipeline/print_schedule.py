"""Print a pipeline schedule's per-rank timeline and bubble, to review a layout before spending GPUs on it.

    python -m megatron_domino.pipeline.print_schedule --pp 4 --microbatches 8 [--virtual 2] [--kind 1f1b]
"""
from __future__ import annotations

import argparse
import sys

from .schedules import build_schedule, implied_chunks, names, schedule_for, schedule_kind, v_shape
from .simulate import Costs, ScheduleError, simulate
from .timeline import render_timeline, summarize


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


def show_run(parallel, num_microbatches: int) -> int:
    """``--print-schedule``: the schedule a run with these settings executes (``schedules.schedule_for``)."""
    try:
        kind, schedule = schedule_for(parallel, num_microbatches)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return show(kind, schedule, num_microbatches, parallel.virtual_pp, Costs(), ops=False)


def show(kind: str, schedule: list[list], num_microbatches: int, virtual_pp: int, costs: Costs, ops: bool) -> int:
    try:
        result = simulate(schedule, num_microbatches, virtual_pp, costs, v_shape=v_shape(kind))
    except ScheduleError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{kind}: pp={len(schedule)} microbatches={num_microbatches} virtual_pp={virtual_pp} "
          f"forward={costs.forward:g} backward={costs.backward:g} comm={costs.comm:g}")
    print(render_timeline(result))
    print(summarize(result))
    if ops:
        for rank, program in enumerate(schedule):
            print(f"rank {rank} ops: " + " ".join(inst.label(virtual_pp > 1) for inst in program))
    return 0


if __name__ == "__main__":
    sys.exit(main())
