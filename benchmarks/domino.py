"""End-to-end Domino benchmark: GPT training steps per tensor-parallel mode, on a throttled link.

One command measures every layout at every link rate (each pair is one torchrun job run inside
benchmarks/throttled.sh, as root, so communication waits on the "wire" instead of fighting compute
for the two CPU cores):

    python benchmarks/domino.py                                  # TP2 and TP2·PP2 at 1 gbit and 4 gbit
    python benchmarks/domino.py --layouts tp2 --rates 1gbit --trace benchmarks/results/domino_trace.json

Inside a job one Trainer per mode is built from the same seed and data; after a warm-up, steps are
timed in interleaved rounds (sync, row-intra, row-inter, column, 2d, nocomm, sync, ...) so drift on a
shared machine hits all modes alike, and medians are reported:
  speed-up         T_sync / T_mode
  hidden fraction  (T_sync - T_mode) / (T_sync - T_nocomm): the share of sync TP's exposed communication
                   that the mode hides (1 = as fast as not communicating at all)
  comm share       (T_sync - T_nocomm) / T_sync: the share of a sync TP step spent communicating (the
                   Domino paper reports up to 47% on H100 clusters; pick the link rate that lands there)
"nocomm" is synchronous TP with every TP all-reduce skipped (wrong numbers: the paper's "optimal" bound).
The first step's loss of every mode (same weights, same batch) is printed too: Domino must not change it.

--trace FILE writes a Chrome trace (chrome://tracing, ui.perfetto.dev) of one step of --trace-mode per
job (FILE gets a _<layout>_<rate> suffix), and prints per rank where the main thread was blocked on
communication: what the traced mode leaves exposed, and where it was issued.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

from common import (MODEL_FLAGS, add_model_args, run_harness,
                    NETEM, RESULTS, build_trainer, format_table,
                    forward_flags, launch, load_benchmark_config, model_overrides, read_json, write_json,
                    tp_communication_skipped)

from megatron_domino.domino.plan import COMPARED_PLANS

LAYOUTS = {"tp2": (2, 1), "tp2pp2": (2, 2)}  # (tp, pp); dp = 1
MODES = {name: plan.overrides() for name, plan in COMPARED_PLANS.items()}
MODES["nocomm"] = COMPARED_PLANS["sync"].overrides()  # timed under common.tp_communication_skipped()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=1024, heads=16, layers=4, seq=256, micro_batch=4)
    parser.add_argument("--layouts", default="tp2,tp2pp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--rates", default="1gbit,4gbit", help="link rates for throttled.sh; 'none': raw loopback")
    parser.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default: pp)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated; must include sync and nocomm")
    parser.add_argument("--rounds", type=int, default=4, help="timed steps per mode (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per mode first (>= 1)")
    parser.add_argument("--trace", default=None, help="Chrome trace of one step per job (suffixed per job)")
    parser.add_argument("--trace-mode", default="row-inter", help="the mode whose step is traced")
    parser.add_argument("--netem", default=NETEM, help="path of throttled.sh")
    parser.add_argument("--json", default=os.path.join(RESULTS, "domino.json"), help="where results go")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="tp2", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--rate", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or "sync" not in modes or "nocomm" not in modes:
        parser.error(f"--modes {args.modes}: unknown {unknown}; sync and nocomm are required (the ratios use "
                     f"them). Fix: pick from {','.join(MODES)}")
    if args.warmup < 1:
        parser.error("--warmup must be >= 1: the first step's losses are compared across modes")
    if args.trace and args.trace_mode not in modes:
        parser.error(f"--trace-mode {args.trace_mode} is not among --modes {args.modes}")
    return args


# ----- worker: one layout at one rate, under torchrun -----------------------------------------------
def timed_step(trainer, mode: str) -> tuple[float, float]:
    import torch.distributed as dist
    dist.barrier()
    start = time.perf_counter()
    with tp_communication_skipped(trainer.state.tp_group) if mode == "nocomm" else contextlib.nullcontext():
        loss = trainer.train_step()["loss"].item()
    dist.barrier()
    return time.perf_counter() - start, loss


def traced_step(trainer, mode: str, path: str) -> list[dict]:
    import torch.distributed as dist
    from spans import SpanRecorder, gather_trace, pipeline_ops, tagged_backward
    recorder = SpanRecorder(dist.get_rank())
    with pipeline_ops(trainer, lambda inst, start, end: recorder.phase(inst.label(True), start, end)), \
            tagged_backward(trainer.chunks):
        dist.barrier()
        with recorder.recording(), \
                tp_communication_skipped(trainer.state.tp_group) if mode == "nocomm" else contextlib.nullcontext():
            trainer.train_step()
    return gather_trace(recorder, path)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(args.threads)
    tp, pp = LAYOUTS[args.layout]
    dp = int(os.environ.get("WORLD_SIZE", "1")) // (tp * pp)
    m = args.microbatches or pp
    modes = args.modes.split(",")
    trainers = {}
    for mode in modes:
        overrides = model_overrides(args, f"domino/{args.layout}/{mode}") + MODES[mode] + [
            f"parallel.tp={tp}", f"parallel.pp={pp}", f"train.global_batch_size={args.micro_batch * dp * m}"]
        trainers[mode] = build_trainer(load_benchmark_config(overrides))
    first_loss = {}
    for _ in range(args.warmup):
        for mode in modes:
            first_loss.setdefault(mode, timed_step(trainers[mode], mode)[1])
    times = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            times[mode].append(timed_step(trainers[mode], mode)[0])
    exposed = None
    if args.trace:
        exposed = traced_step(trainers[args.trace_mode], args.trace_mode, args.trace)
    for trainer in trainers.values():
        trainer.close()
    if dist.get_rank() == 0:
        result = summarize(args, times, first_loss, tp, pp, dp, m)
        result["trace"] = {"file": args.trace, "mode": args.trace_mode, "ranks": exposed} if exposed else None
        print(report(result), flush=True)
        if exposed:
            from spans import format_exposed
            print(f"\ntrace of one {args.trace_mode} step written to {args.trace}; exposed communication per rank:")
            print(format_exposed(exposed), flush=True)
        write_json(args.json, result)


def summarize(args, times: dict, first_loss: dict, tp: int, pp: int, dp: int, m: int) -> dict:
    median = {mode: statistics.median(values) for mode, values in times.items()}
    t_sync, t_free = median["sync"], median["nocomm"]
    exposed = t_sync - t_free
    rows = [{"mode": mode, "median_s": t, "samples_s": times[mode], "speedup": t_sync / t,
             "hidden_fraction": (t_sync - t) / exposed if exposed > 0 else float("nan"),
             "first_step_loss": first_loss.get(mode)} for mode, t in median.items()]
    deviation = max(abs(first_loss[mode] - first_loss["sync"]) for mode in first_loss if mode != "nocomm")
    return {"layout": args.layout, "rate": args.rate, "tp": tp, "pp": pp, "dp": dp, "microbatches": m,
            "args": vars(args), "comm_share_sync": exposed / t_sync, "modes": rows,
            "first_step_loss_max_deviation": deviation}


def report(result: dict) -> str:
    a = result["args"]
    lines = [f"Domino end to end: {result['layout']} (tp {result['tp']}, pp {result['pp']}, dp {result['dp']}) at "
             f"link rate {result['rate']}; GPT hidden {a['hidden']}, heads {a['heads']}, layers {a['layers']}, "
             f"seq {a['seq']}, micro batch {a['micro_batch']} x {result['microbatches']} per step, "
             f"{'bf16' if a['bf16'] else 'fp32'}; median of {a['rounds']} interleaved rounds",
             f"share of sync TP step time spent in communication: {result['comm_share_sync']:.1%} "
             f"(Domino paper: up to 47% on H100 clusters)",
             f"first-step loss equal across modes: max |loss - loss_sync| = "
             f"{result['first_step_loss_max_deviation']:.2e}"]
    rows = [[r["mode"], f"{r['median_s'] * 1e3:.1f}", f"{min(r['samples_s']) * 1e3:.1f}", f"{r['speedup']:.3f}",
             f"{r['hidden_fraction']:.2f}"] for r in result["modes"]]
    return "\n".join(lines + [format_table(["mode", "step ms", "min ms", "speed-up", "hidden"], rows)])


# ----- driver: every layout at every rate ----------------------------------------------------------
def suffixed(path: str, layout: str, rate: str) -> str:
    stem, ext = os.path.splitext(path)
    return f"{stem}_{layout}_{rate}{ext or '.json'}"


def drive(args) -> None:
    layouts, rates = args.layouts.split(","), args.rates.split(",")
    for layout in layouts:
        if layout not in LAYOUTS:
            raise SystemExit(f"--layouts: {layout!r} is not one of {', '.join(LAYOUTS)}")
    runs = []
    for layout in layouts:
        tp, pp = LAYOUTS[layout]
        for rate in rates:
            out = os.path.join(RESULTS, f"domino_{layout}_{rate}.json")
            flags = forward_flags(args, MODEL_FLAGS + ("microbatches", "modes", "rounds", "warmup", "trace_mode"))
            flags += ["--layout", layout, "--rate", rate, "--json", out]
            if args.trace:
                flags += ["--trace", suffixed(args.trace, layout, rate)]
            launch(os.path.abspath(__file__), tp * pp, flags, rate=None if rate == "none" else rate, netem=args.netem)
            runs.append(read_json(out))
    rows = [[run["layout"], run["rate"], f"{run['comm_share_sync']:.1%}", r["mode"], f"{r['median_s'] * 1e3:.1f}",
             f"{r['speedup']:.3f}", f"{r['hidden_fraction']:.2f}"] for run in runs for r in run["modes"]]
    print("\nAll runs (hidden = (T_sync - T_mode) / (T_sync - T_nocomm); comm = sync's communication share):")
    print(format_table(["layout", "rate", "comm", "mode", "step ms", "speed-up", "hidden"], rows))
    print(f"results: {write_json(args.json, {'runs': runs})}")


if __name__ == "__main__":
    run_harness(parse_args(), worker, drive)
