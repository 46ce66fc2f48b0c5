"""Pipeline bubble: per-stage busy and idle time of 1F1B and interleaved 1F1B (v = 2) at pp = 4, beside theory.

    python benchmarks/pipeline.py                      # m = 4, 8, 16 micro-batches, both schedules

One torchrun job of 4 ranks (tp = dp = 1) trains the GPT below for each (schedule, m), one Trainer at a
time. Every forward and backward the pipeline executor runs is timed on its rank. Per step, the makespan is
the first op's start to the last op's end over all ranks (every rank starts together after a barrier, as
in the theory); a rank's busy time is the sum of its ops and its idle time the rest. Medians over the
timed steps are printed beside three predictions:
  closed form     (pp - 1) / (m + pp - 1) for 1F1B, (pp - 1) / (v*m + pp - 1) interleaved (equal stages)
  sim unit        megatron_domino.pipeline.simulate on the real schedule, forward 1 and backward 2
  sim measured    the same simulation fed this run's median forward/backward time of every virtual stage
                  (the first stage also embeds, the last also computes the head and the loss)
On 2 shared CPU cores the 4 ranks also compete for compute: ops run slower when more ranks are busy (the
steady state) than in the ramp-up and ramp-down, which shrinks the measured bubble against the theory.
"""
from __future__ import annotations

import argparse
import os
import statistics
from collections import defaultdict

from common import (MODEL_FLAGS, add_model_args, run_harness,
                    RESULTS, build_trainer, close_trainer, format_table, forward_flags,
                    launch, load_benchmark_config, model_overrides, read_json, write_json)

PP = 4
SCHEDULES = {"1f1b": 1, "interleaved": 2}  # name -> virtual_pp


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=512, heads=8, layers=8, seq=256, micro_batch=2)
    parser.add_argument("--microbatches", default="4,8,16", help="comma-separated m (multiples of pp = 4)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"of {', '.join(SCHEDULES)}")
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per configuration (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration first")
    parser.add_argument("--json", default=os.path.join(RESULTS, "pipeline.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in args.schedules.split(","):
        if name not in SCHEDULES:
            parser.error(f"--schedules: {name!r} is not one of {', '.join(SCHEDULES)}")
    stages = PP * max(SCHEDULES[name] for name in args.schedules.split(","))
    if args.layers % stages:
        parser.error(f"--layers {args.layers}: must be a multiple of pp * virtual_pp = {stages} (equal stages)")
    return args


def closed_form(m: int, v: int) -> float:
    return (PP - 1) / (v * m + PP - 1)


# ----- worker ------------------------------------------------------------------------------------
def measure(args, schedule: str, m: int) -> list[list[tuple]] | None:
    """Per timed step, every rank's ops as (op, chunk, microbatch, start, end); on rank 0, None elsewhere."""
    import torch.distributed as dist
    from spans import pipeline_ops
    v = SCHEDULES[schedule]
    overrides = model_overrides(args, f"pipeline/{schedule}-{m}") + [
        "parallel.tp=1", "parallel.domino=false", f"parallel.pp={PP}", f"parallel.virtual_pp={v}",
        f"train.global_batch_size={args.micro_batch * m}"]
    trainer = build_trainer(load_benchmark_config(overrides))
    ops: list[tuple] = []
    record = lambda inst, start, end: ops.append((inst.op, inst.chunk, inst.microbatch, start, end))  # noqa: E731
    steps = []
    with pipeline_ops(trainer, record):
        for step in range(args.warmup + args.rounds):
            ops.clear()
            dist.barrier()
            trainer.train_step()
            if step >= args.warmup:
                steps.append(list(ops))
    close_trainer(trainer)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, steps)
    return everyone if dist.get_rank() == 0 else None


def analyse(everyone: list, schedule: str, m: int) -> dict:
    """Busy / idle per rank (medians over steps) and the three predictions."""
    from megatron_domino.pipeline.schedules import build_schedule, schedule_kind, virtual_stage
    from megatron_domino.pipeline.simulate import Costs, simulate
    v = SCHEDULES[schedule]
    kind = schedule_kind(PP, v)
    steps = len(everyone[0])
    busy, idle, makespans = defaultdict(list), defaultdict(list), []
    durations = defaultdict(list)  # (op, virtual stage) -> seconds
    for k in range(steps):
        per_rank = [everyone[r][k] for r in range(PP)]
        start = min(op[3] for ops in per_rank for op in ops)
        end = max(op[4] for ops in per_rank for op in ops)
        makespans.append(end - start)
        for rank, ops in enumerate(per_rank):
            busy[rank].append(sum(e - s for *_, s, e in ops))
            idle[rank].append(end - start - busy[rank][-1])
            for op, chunk, _, s, e in ops:
                durations[(op, virtual_stage(rank, chunk, PP))].append(e - s)
    stages = PP * v
    measured = Costs(forward=[statistics.median(durations[("forward", s)]) for s in range(stages)],
                     backward=[statistics.median(durations[("backward", s)]) for s in range(stages)])
    program = build_schedule(kind, PP, m, v)
    unit, real = simulate(program, m, v), simulate(program, m, v, measured)
    ranks = []
    for rank in range(PP):
        b, i = statistics.median(busy[rank]), statistics.median(idle[rank])
        ranks.append({"rank": rank, "busy_s": b, "idle_s": i, "idle_fraction": i / (b + i),
                      "sim_measured_idle_fraction": real.idle_fraction[rank],
                      "sim_unit_idle_fraction": unit.idle_fraction[rank]})
    return {"schedule": schedule, "virtual_pp": v, "microbatches": m, "makespan_s": statistics.median(makespans),
            "closed_form_bubble": closed_form(m, v), "sim_unit_bubble": unit.bubble_fraction,
            "sim_measured_bubble": real.bubble_fraction, "measured_bubble": sum(r["idle_s"] for r in ranks) /
            sum(r["busy_s"] + r["idle_s"] for r in ranks), "forward_s_per_stage": list(measured.forward),
            "backward_s_per_stage": list(measured.backward), "ranks": ranks}


def worker(args) -> None:
    import torch
    torch.set_num_threads(args.threads)
    results = []
    for schedule in args.schedules.split(","):
        for m in (int(x) for x in args.microbatches.split(",")):
            everyone = measure(args, schedule, m)
            if everyone is not None:
                results.append(analyse(everyone, schedule, m))
    if results:
        write_json(args.json, {"args": vars(args), "pp": PP, "configs": results})


def report(data: dict) -> str:
    a = data["args"]
    rows = []
    for c in data["configs"]:
        for r in c["ranks"]:
            rows.append([c["schedule"], c["microbatches"], r["rank"], f"{r['busy_s'] * 1e3:.0f}",
                         f"{r['idle_s'] * 1e3:.0f}", f"{r['idle_fraction']:.1%}",
                         f"{r['sim_measured_idle_fraction']:.1%}", f"{r['sim_unit_idle_fraction']:.1%}",
                         f"{c['closed_form_bubble']:.1%}"])
    summary = [[c["schedule"], c["microbatches"], f"{c['makespan_s'] * 1e3:.0f}", f"{c['measured_bubble']:.1%}",
                f"{c['sim_measured_bubble']:.1%}", f"{c['sim_unit_bubble']:.1%}", f"{c['closed_form_bubble']:.1%}",
                " ".join(f"{f * 1e3:.0f}/{b * 1e3:.0f}" for f, b in zip(c["forward_s_per_stage"],
                                                                      c["backward_s_per_stage"]))]
               for c in data["configs"]]
    return "\n".join([
        f"Pipeline bubble at pp = {data['pp']}: GPT hidden {a['hidden']}, layers {a['layers']}, seq {a['seq']}, "
        f"micro batch {a['micro_batch']}; median of {a['rounds']} steps",
        format_table(["schedule", "m", "rank", "busy ms", "idle ms", "idle", "sim measured", "sim unit",
                      "closed form"], rows), "",
        format_table(["schedule", "m", "step ms", "bubble", "sim measured", "sim unit", "closed form",
                      "F/B ms per virtual stage"], summary)])


def drive(args) -> None:
    flags = forward_flags(args, MODEL_FLAGS + ("microbatches", "schedules", "rounds", "warmup", "json"))
    launch(os.path.abspath(__file__), PP, flags)
    print(report(read_json(args.json)))
    print(f"results: {args.json}")


if __name__ == "__main__":
    run_harness(parse_args(), worker, drive)
