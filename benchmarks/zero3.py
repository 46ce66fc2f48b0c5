"""ZeRO-3 step time against ZeRO-1 at the same layout, on a throttled link, with and without prefetch.

    python benchmarks/zero3.py                       # dp 2 at 4 gbit
    python benchmarks/zero3.py --rates 1gbit,4gbit --dp 2

One torchrun job per link rate (inside benchmarks/throttled.sh, so a gather waits on the "wire" instead of
fighting compute for the CPU cores). In a job one Trainer per mode is built from the same seed and data,
and steps are timed in interleaved rounds (zero1, zero2, zero3, zero3-no-prefetch, zero1, ...); medians:
  vs zero1         T_mode / T_zero1 (the issue's bound for zero3: <= 1.15 at 4 gbit)
  hidden fraction  (T_noprefetch - T_mode) / (T_noprefetch - T_zero2): the share of the layer gathers' cost
                   that prefetch hides. ZeRO-2 has ZeRO-3's gradient traffic (a reduce-scatter per micro-batch)
                   and no layer gathers; ZeRO-3 without prefetch gathers each layer when needed and waits.
The first step's loss of every mode (same weights, same batch) is printed too: the stage must not change it.
"""
from __future__ import annotations

import argparse
import os
import statistics

from common import (MODEL_FLAGS, RESULTS, add_model_args, add_throttled_job_args, build_trainer, format_table,
                    forward_flags, launch, load_benchmark_config, model_overrides, read_json, run_harness, write_json)
from domino import timed_step

MODES = {"zero1": ["optimizer.zero_stage=1"],
         "zero2": ["optimizer.zero_stage=2"],
         "zero3": ["optimizer.zero_stage=3", "optimizer.prefetch_depth=1"],
         "zero3-no-prefetch": ["optimizer.zero_stage=3", "optimizer.prefetch_depth=0"]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # 4096 tokens per micro-batch: a layer's gathered bytes per token as in real runs (a GPU's micro-batch holds
    # thousands of tokens); at a few hundred tokens the gathers' own CPU copies cost two cores more than the wire
    add_model_args(parser, hidden=512, heads=8, layers=4, seq=512, micro_batch=8)
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks (tp = pp = 1)")
    parser.add_argument("--microbatches", type=int, default=2, help="micro-batches per step per rank")
    parser.add_argument("--rates", default="4gbit", help="link rates for throttled.sh; 'none': raw loopback")
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per mode (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per mode first (>= 1)")
    add_throttled_job_args(parser, "zero3")
    return parser.parse_args(argv)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(args.threads)
    dp = int(os.environ.get("WORLD_SIZE", "1"))
    trainers = {mode: build_trainer(load_benchmark_config(
        model_overrides(args, f"zero3/{mode}") + overrides + [
            "parallel.tp=1", "parallel.pp=1", "parallel.domino=false",
            f"train.global_batch_size={args.micro_batch * dp * args.microbatches}"]))
        for mode, overrides in MODES.items()}
    first_loss = {}
    for _ in range(args.warmup):
        for mode, trainer in trainers.items():
            first_loss.setdefault(mode, timed_step(trainer, mode)[1])
    times = {mode: [] for mode in trainers}
    for _ in range(args.rounds):
        for mode, trainer in trainers.items():
            times[mode].append(timed_step(trainer, mode)[0])
    for trainer in trainers.values():
        trainer.close()
    if dist.get_rank() == 0:
        median = {mode: statistics.median(values) for mode, values in times.items()}
        base, no_gathers, slow = median["zero1"], median["zero2"], median["zero3-no-prefetch"]
        rows = [{"mode": mode, "median_s": t, "samples_s": times[mode], "vs_zero1": t / base,
                 "hidden_fraction": (slow - t) / (slow - no_gathers) if slow > no_gathers else float("nan"),
                 "first_step_loss": first_loss[mode]} for mode, t in median.items()]
        result = {"rate": args.rate, "dp": dp, "args": vars(args), "modes": rows,
                  "first_step_loss_max_deviation": max(abs(v - first_loss["zero1"]) for v in first_loss.values())}
        print(report(result), flush=True)
        write_json(args.json, result)


def report(result: dict) -> str:
    a = result["args"]
    head = (f"ZeRO-3 vs ZeRO-1 at dp {result['dp']}, link rate {result['rate']}: GPT hidden {a['hidden']}, layers "
            f"{a['layers']}, seq {a['seq']}, micro batch {a['micro_batch']} x {a['microbatches']} per step, "
            f"{'bf16' if a['bf16'] else 'fp32'}; median of {a['rounds']} interleaved rounds; first-step loss "
            f"max |loss - loss_zero1| = {result['first_step_loss_max_deviation']:.2e}")
    rows = [[r["mode"], f"{r['median_s'] * 1e3:.1f}", f"{min(r['samples_s']) * 1e3:.1f}", f"{r['vs_zero1']:.3f}",
             f"{r['hidden_fraction']:.2f}"] for r in result["modes"]]
    return "\n".join([head, format_table(["mode", "step ms", "min ms", "vs zero1", "hidden"], rows)])


def drive(args) -> None:
    runs = []
    for rate in args.rates.split(","):
        out = os.path.join(RESULTS, f"zero3_{rate}.json")
        flags = forward_flags(args, MODEL_FLAGS + ("microbatches", "rounds", "warmup")) + [
            "--rate", rate, "--json", out]
        launch(os.path.abspath(__file__), args.dp, flags, rate=None if rate == "none" else rate, netem=args.netem)
        runs.append(read_json(out))
    print(f"results: {write_json(args.json, {'runs': runs})}")


if __name__ == "__main__":
    run_harness(parse_args(), worker, drive)
