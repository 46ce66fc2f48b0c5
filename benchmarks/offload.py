"""CPU offload: how much of the host's optimizer step the next step's forward hides (``optim/host_step.py``).

    python benchmarks/offload.py                 # one rank: its main thread and the host thread, 2 cores
    python benchmarks/offload.py --dp 2

One torchrun job; in it one Trainer per mode from the same seed and data, each timed over consecutive steps
(the overlap reaches from one step into the next, so modes are not interleaved):
  device         no offload: the optimizer steps where the weights are (here the CPU too)
  offload-sync   optimizer.offload=cpu, overlap_offload_step=false: the step waits for the host's update
  offload        optimizer.offload=cpu, the host thread steps while the next forward runs
Reported: median step time, the host thread's time per step (its ``_step_bucket`` calls, in offload-sync), and
  hidden fraction  (T_offload-sync - T_offload) / host time: the share of the host step the forward hides.
On this 2-core machine the host thread and the forward share the cores with the other ranks: at dp 1 one core
each. On a GPU node the forward runs on the device and the host step on otherwise idle cores.
The first step's loss of every mode is printed: offload must not change it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from common import (MODEL_FLAGS, RESULTS, add_model_args, build_trainer, format_table, forward_flags, launch,
                    load_benchmark_config, model_overrides, read_json, run_harness, write_json)
from domino import timed_step

MODES = {"device": ["optimizer.offload=null"],
         "offload-sync": ["optimizer.offload=cpu", "optimizer.overlap_offload_step=false"],
         "offload": ["optimizer.offload=cpu", "optimizer.overlap_offload_step=true"]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=512, heads=8, layers=4, seq=128, micro_batch=2, vocab=8192)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (tp = pp = 1)")
    parser.add_argument("--microbatches", type=int, default=1, help="micro-batches per step per rank")
    parser.add_argument("--rounds", type=int, default=9, help="timed steps per mode (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first (>= 1)")
    parser.add_argument("--json", default=os.path.join(RESULTS, "offload.json"), help="where results go")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _clock_host_thread(trainer) -> list:
    """Seconds the host thread spends stepping buckets, accumulated into the returned one-element list."""
    spent, host = [0.0], trainer.optimizer.host
    step_bucket = host._step_bucket

    def timed(indices, copied):
        start = time.perf_counter()
        step_bucket(indices, copied)
        spent[0] += time.perf_counter() - start
    host._step_bucket = timed
    return spent


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(args.threads)
    dp = int(os.environ.get("WORLD_SIZE", "1"))
    trainers = {mode: build_trainer(load_benchmark_config(
        model_overrides(args, f"offload/{mode}") + overrides + [
            "parallel.tp=1", "parallel.pp=1", "parallel.domino=false", "optimizer.zero_stage=1",
            f"train.global_batch_size={args.micro_batch * dp * args.microbatches}"]))
        for mode, overrides in MODES.items()}
    clock = _clock_host_thread(trainers["offload-sync"])
    first_loss, times, host = {}, {mode: [] for mode in trainers}, []
    for mode, trainer in trainers.items():  # consecutive steps: the overlap spans one step into the next
        for step in range(args.warmup + args.rounds):
            before = clock[0]
            took, loss = timed_step(trainer, mode)
            first_loss.setdefault(mode, loss)
            if step >= args.warmup:
                times[mode].append(took)
                if mode == "offload-sync":  # its host step lies inside its own step
                    host.append(clock[0] - before)
        trainer.optimizer.settle()  # nothing of this mode runs into the next one's steps
    for trainer in trainers.values():
        trainer.close()
    if dist.get_rank() == 0:
        median = {mode: statistics.median(values) for mode, values in times.items()}
        host_s = statistics.median(host)
        hidden = (median["offload-sync"] - median["offload"]) / host_s
        rows = [{"mode": mode, "median_s": t, "samples_s": times[mode], "vs_device": t / median["device"],
                 "first_step_loss": first_loss[mode]} for mode, t in median.items()]
        result = {"dp": dp, "args": vars(args), "modes": rows, "host_s": host_s, "hidden_fraction": hidden,
                  "first_step_loss_max_deviation": max(abs(v - first_loss["device"]) for v in first_loss.values())}
        print(report(result), flush=True)
        write_json(args.json, result)


def report(result: dict) -> str:
    a = result["args"]
    head = (f"CPU offload at dp {result['dp']}: GPT hidden {a['hidden']}, layers {a['layers']}, seq {a['seq']}, "
            f"micro batch {a['micro_batch']} x {a['microbatches']} per step, vocab {a['vocab']}, "
            f"{'bf16' if a['bf16'] else 'fp32'}, {a['threads']} torch thread(s); median of {a['rounds']} "
            f"consecutive steps; first-step loss max |loss - loss_device| = "
            f"{result['first_step_loss_max_deviation']:.2e}")
    rows = [[r["mode"], f"{r['median_s'] * 1e3:.1f}", f"{min(r['samples_s']) * 1e3:.1f}", f"{r['vs_device']:.3f}"]
            for r in result["modes"]]
    table = format_table(["mode", "step ms", "min ms", "vs device"], rows)
    return (f"{head}\n{table}\nhost thread's step: {result['host_s'] * 1e3:.1f} ms; hidden fraction "
            f"(T_offload-sync - T_offload) / host step: {result['hidden_fraction']:.2f}")


def drive(args) -> None:
    flags = forward_flags(args, MODEL_FLAGS + ("microbatches", "rounds", "warmup", "json"))
    launch(os.path.abspath(__file__), args.dp, flags, rate=None)
    print(f"results: {args.json}")
    read_json(args.json)


if __name__ == "__main__":
    run_harness(parse_args(), worker, drive)
