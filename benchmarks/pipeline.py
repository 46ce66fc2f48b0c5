"""Pipeline bubble: per-stage busy and idle time of 1F1B, interleaved 1F1B (v = 2), ZB-H1 and the two V schedules,
ZB-V and DualPipeV (v = 2), at pp = 4 (or 2), beside theory.

    python benchmarks/pipeline.py                      # m = 4, 8, 16 micro-batches, every schedule
    python benchmarks/pipeline.py --stage-cost sleep:300 --hidden 64 --seq 32 --microbatches 16 [--pp 2]
                                                       # fixed-time stages, as the peers were measured

``--stage-cost sleep:MS`` pads every op to a fixed time (the model still runs, tiny, inside it): a forward
MS, a backward (B) 2·MS, split evenly into I and W where the schedule splits it; a chunk's op 1/v of that with
v chunks per rank (interleaved and the V: a chunk's F, I and W MS/2 each, its B MS). DualPipeV's F&B unit
(``program.Overlapped``) runs, is padded and is timed as its two halves, a forward and a backward. The idle
fraction then no longer depends on how many cores the ranks share. The model must run well inside MS (the
report warns when an op overran its cost), and what remains is the machine's latency per transfer: about
0.8 ms from a send to a sleeping receiver's wake-up on these VMs, 0.8% of a 100 ms forward on each edge of the
schedule's critical path, 0.3% of a 300 ms one (twice that share of the V's and interleaving's MS/2 chunk ops).

One torchrun job of pp ranks (tp = dp = 1) trains the GPT below for each (schedule, m), one Trainer at a
time. Every forward and backward the pipeline executor runs is timed on its rank. Per step, the makespan is
the first op's start to the last op's end over all ranks (every rank starts together after a barrier, as
in the theory); a rank's busy time is the sum of its ops and its idle time the rest. Medians over the
timed steps are printed beside three predictions:
  closed form     (pp - 1) / (m + pp - 1) for 1F1B, (pp - 1) / (v*m + pp - 1) interleaved (equal stages),
                  (pp - 1) / (3m + pp - 1) ZB-H1, (pp - 1) / (6m + pp - 1) ZB-V (m >= pp) and
                  (7pp - 5) / (6m + 7pp - 5) DualPipeV (m >= 2 pp; the F&B unit costs F + B, no overlap credited)
  sim unit        megatron_domino.pipeline.simulate on the real schedule, forward 1 and backward 2
  sim measured    the same simulation fed this run's median forward/backward time of every virtual stage
                  (the first stage also embeds, the last also computes the head and the loss)
A configuration the schedule cannot run (zb-v: m < pp, dualpipev: m < 2 pp, interleaved: m not a multiple of pp)
is skipped with the reason. Beside the bubble: the most chunk-micro-batches holding activations at once on each
rank, counted in the run (forward to backward, or to W), and the peak over ranks in stages' worth (/ v): pp for
1F1B and ZB-H1 (rank 0), 2 pp chunks = pp stages on every rank for ZB-V, 2 pp + 1 chunks for DualPipeV.
On 2 shared CPU cores the 4 ranks also compete for compute: ops run slower when more ranks are busy (the
steady state) than in the ramp-up and ramp-down, which shrinks the measured bubble against the theory.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections import defaultdict

from common import (MODEL_FLAGS, add_model_args, run_harness,
                    RESULTS, build_trainer, format_table, forward_flags,
                    launch, load_benchmark_config, model_overrides, read_json, write_json)

from pipeline_theory import SCHEDULES, V_SHAPED, closed_form, closed_form_peak, peak_in_flight, unmet


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=512, heads=8, layers=8, seq=256, micro_batch=2)
    parser.add_argument("--pp", type=int, choices=(2, 4), default=4, help="pipeline ranks (one process each)")
    parser.add_argument("--microbatches", default="4,8,16",
                        help="comma-separated m (multiples of pp; zb-v needs m >= pp, dualpipev m >= 2 pp)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"of {', '.join(SCHEDULES)}")
    parser.add_argument("--stage-cost", default=None, metavar="sleep:MS",
                        help="pad each forward to MS ms, each backward to 2 MS (I and W MS each; a chunk's op 1/v "
                             "of that) instead of timing the model's compute")
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per configuration (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration first")
    parser.add_argument("--json", default=os.path.join(RESULTS, "pipeline.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in args.schedules.split(","):
        if name not in SCHEDULES:
            parser.error(f"--schedules: {name!r} is not one of {', '.join(SCHEDULES)}")
    if args.stage_cost is not None and not (args.stage_cost.startswith("sleep:") and
                                            _is_positive(args.stage_cost[len("sleep:"):])):
        parser.error(f"--stage-cost {args.stage_cost!r}: expected sleep:MS with MS > 0, e.g. sleep:50")
    stages = args.pp * max(SCHEDULES[name] for name in args.schedules.split(","))
    if args.layers % stages:
        parser.error(f"--layers {args.layers}: must be a multiple of pp * virtual_pp = {stages} (equal stages)")
    return args


def _is_positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


@contextlib.contextmanager
def fixed_costs(executor, milliseconds: float, virtual_pp: int):
    """Every op of ``executor`` lasts exactly its share of ``milliseconds`` (the op itself runs inside)."""
    unit = milliseconds / 1e3 / virtual_pp
    forward, backward = executor._forward, executor._backward

    def padded(op, cost):
        def run(*args):
            start = time.perf_counter()
            result = op(*args)
            time.sleep(max(0.0, start + cost(*args) - time.perf_counter()))
            return result
        return run

    executor._forward = padded(forward, lambda *args: unit)
    executor._backward = padded(backward, lambda step, *rest: 2 * unit if step.op == "backward" else unit)
    try:
        yield
    finally:  # pipeline_ops may have removed the wrappers already
        vars(executor).pop("_forward", None)
        vars(executor).pop("_backward", None)


# ----- worker ------------------------------------------------------------------------------------
def measure(args, schedule: str, m: int) -> list[list[tuple]] | None:
    """Per timed step, every rank's ops as (op, chunk, microbatch, start, end); on rank 0, None elsewhere."""
    import torch.distributed as dist
    from spans import pipeline_ops
    v = SCHEDULES[schedule]
    overrides = model_overrides(args, f"pipeline/{schedule}-{m}") + [
        "parallel.tp=1", "parallel.domino=false", f"parallel.pp={args.pp}", f"parallel.virtual_pp={v}",
        f"parallel.pipeline_schedule={schedule}", f"train.global_batch_size={args.micro_batch * m}"]
    trainer = build_trainer(load_benchmark_config(overrides))
    ops: list[tuple] = []
    record = lambda inst, start, end: ops.append((inst.op, inst.chunk, inst.microbatch, start, end))  # noqa: E731
    steps = []
    sleep = float(args.stage_cost.split(":")[1]) if args.stage_cost else None
    padding = fixed_costs(trainer.engine.executor, sleep, v) if sleep else contextlib.nullcontext()
    with padding, pipeline_ops(trainer, record):
        for step in range(args.warmup + args.rounds):
            ops.clear()
            dist.barrier()
            trainer.train_step()
            if step >= args.warmup:
                steps.append(list(ops))
    trainer.close()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, steps)
    return everyone if dist.get_rank() == 0 else None


def analyse(everyone: list, schedule: str, m: int, pp: int) -> dict:
    """Busy / idle per rank (medians over steps) and the three predictions."""
    from megatron_domino.pipeline.program import virtual_stage
    from megatron_domino.pipeline.schedules import build_schedule
    from megatron_domino.pipeline.simulate import Costs, simulate
    v, v_shape = SCHEDULES[schedule], schedule in V_SHAPED
    steps = len(everyone[0])
    busy, idle, makespans = defaultdict(list), defaultdict(list), []
    durations = defaultdict(list)  # (op, virtual stage) -> seconds
    for k in range(steps):
        per_rank = [everyone[r][k] for r in range(pp)]
        start = min(op[3] for ops in per_rank for op in ops)
        end = max(op[4] for ops in per_rank for op in ops)
        makespans.append(end - start)
        for rank, ops in enumerate(per_rank):
            busy[rank].append(sum(e - s for *_, s, e in ops))
            idle[rank].append(end - start - busy[rank][-1])
            for op, chunk, _, s, e in ops:
                durations[(op, virtual_stage(rank, chunk, pp, v_shape))].append(e - s)
    stages = pp * v
    median = lambda op: [statistics.median(durations[(op, s)]) if durations[(op, s)] else None  # noqa: E731
                         for s in range(stages)]
    # B where the schedule runs whole backwards (dualpipev runs both kinds: the simulator's I is then B - W), else I + W
    weight = median("backward_weight")
    backward = [b if b is not None else i + w for b, i, w in zip(median("backward"), median("backward_input"), weight)]
    split = any(w is not None for w in weight)
    weight = [w if w is not None else b / 2 for w, b in zip(weight, backward)] if split else None
    measured = Costs(forward=median("forward"), backward=backward, weight=weight)
    program = build_schedule(schedule, pp, m, v)
    unit, real = simulate(program, m, v, v_shape=v_shape), simulate(program, m, v, measured, v_shape=v_shape)
    in_flight = [peak_in_flight(everyone[rank][0]) for rank in range(pp)]
    ranks = []
    for rank in range(pp):
        b, i = statistics.median(busy[rank]), statistics.median(idle[rank])
        ranks.append({"rank": rank, "busy_s": b, "idle_s": i, "idle_fraction": i / (b + i),
                      "sim_measured_idle_fraction": real.idle_fraction[rank],
                      "sim_unit_idle_fraction": unit.idle_fraction[rank], "in_flight": in_flight[rank],
                      "sim_in_flight": unit.max_in_flight[rank]})
    return {"schedule": schedule, "virtual_pp": v, "microbatches": m, "makespan_s": statistics.median(makespans),
            "closed_form_bubble": closed_form(schedule, m, pp), "sim_unit_bubble": unit.bubble_fraction,
            "sim_measured_bubble": real.bubble_fraction, "measured_bubble": sum(r["idle_s"] for r in ranks) /
            sum(r["busy_s"] + r["idle_s"] for r in ranks), "forward_s_per_stage": list(measured.forward),
            "backward_s_per_stage": list(measured.backward), "peak_in_flight": max(in_flight),
            "closed_form_peak": closed_form_peak(schedule, m, pp), "ranks": ranks}


def worker(args) -> None:
    import torch
    torch.set_num_threads(args.threads)
    results = []
    for schedule, m in runnable(args):
        everyone = measure(args, schedule, m)
        if everyone is not None:
            results.append(analyse(everyone, schedule, m, args.pp))
    if results:
        write_json(args.json, {"args": vars(args), "pp": args.pp, "configs": results})


def configurations(args) -> list[tuple[str, int, str | None]]:
    """Every (schedule, m) asked for, with why it cannot run (None: it can)."""
    ms = [int(x) for x in args.microbatches.split(",")]
    return [(schedule, m, unmet(schedule, m, args.pp)) for schedule in args.schedules.split(",") for m in ms]


def runnable(args) -> list[tuple[str, int]]:
    return [(schedule, m) for schedule, m, reason in configurations(args) if reason is None]


def report(data: dict) -> str:
    a = data["args"]
    rows = []
    for c in data["configs"]:
        for r in c["ranks"]:
            rows.append([c["schedule"], c["microbatches"], r["rank"], f"{r['busy_s'] * 1e3:.0f}",
                         f"{r['idle_s'] * 1e3:.0f}", f"{r['idle_fraction']:.1%}",
                         f"{r['sim_measured_idle_fraction']:.1%}", f"{r['sim_unit_idle_fraction']:.1%}",
                         f"{c['closed_form_bubble']:.1%}", r["in_flight"]])
    summary = [[c["schedule"], c["microbatches"], f"{c['makespan_s'] * 1e3:.0f}", f"{c['measured_bubble']:.1%}",
                f"{c['sim_measured_bubble']:.1%}", f"{c['sim_unit_bubble']:.1%}", f"{c['closed_form_bubble']:.1%}",
                f"{c['peak_in_flight']} / {c['closed_form_peak']} = {c['peak_in_flight'] / c['virtual_pp']:g}",
                " ".join(f"{f * 1e3:.0f}/{b * 1e3:.0f}" for f, b in zip(c["forward_s_per_stage"],
                                                                      c["backward_s_per_stage"]))]
               for c in data["configs"]]
    return "\n".join([
        f"Pipeline bubble at pp = {data['pp']}: GPT hidden {a['hidden']}, layers {a['layers']}, seq {a['seq']}, "
        f"{'stage cost ' + a['stage_cost'] + ', ' if a.get('stage_cost') else ''}"
        f"micro batch {a['micro_batch']}; median of {a['rounds']} steps",
        format_table(["schedule", "m", "rank", "busy ms", "idle ms", "idle", "sim measured", "sim unit",
                      "closed form", "in flight"], rows), "",
        format_table(["schedule", "m", "step ms", "bubble", "sim measured", "sim unit", "closed form",
                      "peak in flight", "F/B ms per virtual stage"], summary),
        "in flight: most chunk-micro-batches holding activations at once on a rank, counted in the run; peak: the "
        "most on any rank / its closed form = in stages' worth (/ v)"])


def overruns(data: dict) -> list[str]:
    """Stages whose median op outlasted its fixed cost (the model is too slow for ``--stage-cost``)."""
    if not data["args"].get("stage_cost"):
        return []
    unit = float(data["args"]["stage_cost"].split(":")[1]) / 1e3
    found = []
    for c in data["configs"]:
        forward = unit / c["virtual_pp"]
        for stage, (f, b) in enumerate(zip(c["forward_s_per_stage"], c["backward_s_per_stage"])):
            if f > 1.02 * forward or b > 1.02 * 2 * forward:
                found.append(f"{c['schedule']} m {c['microbatches']} stage {stage}: {f * 1e3:.0f}/{b * 1e3:.0f} ms "
                             f"for {forward * 1e3:.0f}/{2 * forward * 1e3:.0f}")
    return found


def drive(args) -> None:
    for schedule, m, reason in configurations(args):
        if reason is not None:
            print(f"skipped {schedule} at m = {m}, pp = {args.pp}: {reason}")
    if not runnable(args):
        raise SystemExit("nothing to run: every (schedule, m) was skipped. Fix: --microbatches of at least 2 * pp")
    flags = forward_flags(args, MODEL_FLAGS + ("pp", "microbatches", "schedules", "stage_cost", "rounds", "warmup",
                                               "json"))
    launch(os.path.abspath(__file__), args.pp, flags)
    data = read_json(args.json)
    print(report(data))
    late = overruns(data)
    if late:
        print(f"WARNING: {len(late)} stage(s) ran longer than their fixed cost, so the idle fractions above are not "
              f"those of fixed-time stages (e.g. {late[0]}). Fix: a smaller model (--hidden 64 --seq 32) or a "
              f"larger MS")
    print(f"results: {args.json}")


if __name__ == "__main__":
    run_harness(parse_args(), worker, drive)
