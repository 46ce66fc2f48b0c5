"""torch.compile (``model.compile``) against eager: training tokens/s of a ~110M GPT at tp 1 and at tp 2 with Domino.

    python benchmarks/compile_speed.py                  # 12 layers, hidden 768, seq 512, micro batch 2, vocab 32000
    python benchmarks/compile_speed.py --layouts tp1 --hidden 64 --heads 4 --layers 2 --seq 32 --vocab 256 --rounds 1

One job per layout (a bare process for tp1, a 2-rank torchrun job for tp2, Domino on) holds two Trainers from
the same seed and mock data, eager and compiled (the same computation: their losses are compared), and
steps them in interleaved rounds (the order alternates every round) after ``--warmup`` untimed steps each,
the first compiled one including the compilation. A step is timed from a barrier to the slowest rank's end;
tokens/s is micro batch x seq over the median step. What is compiled (norms, activation, RoPE, residual) and
what stays eager (GEMMs, attention, communication): ``megatron_domino/models/compiled.py``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from common import (MODEL_FLAGS, RESULTS, add_model_args, build_trainer, forward_flags, launch, load_benchmark_config,
                    model_overrides, read_json, run_harness, write_json)

LAYOUTS = {"tp1": 1, "tp2": 2}  # name -> tensor-parallel ranks (Domino on where tp > 1)
# --family llama: the same sizes with Llama's elementwise work (RMSNorm, SwiGLU, RoPE, no biases), which fuses more
FAMILIES = {"gpt": [], "llama": ["model.norm=rmsnorm", "model.activation=swiglu", "model.position_embedding=rope",
                                 "model.bias=false"]}
MODES = ("eager", "compiled")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=768, heads=12, layers=12, seq=512, micro_batch=2, vocab=32000)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    parser.add_argument("--family", choices=FAMILIES, default="gpt", help="gpt (default) or llama's elementwise ops")
    parser.add_argument("--rounds", type=int, default=4, help="timed steps of each mode (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each mode first (compiles)")
    parser.add_argument("--cache-dir", default=None, help="model.compile_cache_dir (default: torch's)")
    parser.add_argument("--json", default=os.path.join(RESULTS, "compile_speed.json"))
    parser.add_argument("--layout", choices=LAYOUTS, default="tp1", help=argparse.SUPPRESS)  # a worker's
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in args.layouts.split(","):
        if name not in LAYOUTS:
            parser.error(f"--layouts: {name!r} is not one of {', '.join(LAYOUTS)}")
    if args.rounds < 1 or args.warmup < 1:
        parser.error("--rounds and --warmup: at least 1 (the first compiled step compiles)")
    return args


def layout_json(path: str, layout: str) -> str:
    return f"{os.path.splitext(path)[0]}_{layout}.json"


# ----- worker ------------------------------------------------------------------------------------
def timed_step(trainer) -> tuple[float, float]:
    """(loss, seconds from a barrier to the slowest rank's end) of one training step."""
    import torch
    import torch.distributed as dist
    dist.barrier()
    start = time.perf_counter()
    loss = trainer.train_step()["loss"].item()  # waits for the device
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=trainer.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return loss, elapsed.item()


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(args.threads)
    tp = LAYOUTS[args.layout]
    overrides = model_overrides(args, f"compile_speed/{args.layout}") + [
        f"parallel.tp={tp}", "parallel.pp=1", f"parallel.domino={'true' if tp > 1 else 'false'}",
        "optimizer.lr_schedule=constant", f"train.global_batch_size={args.micro_batch}"] + FAMILIES[args.family]
    if args.cache_dir:
        overrides.append(f"model.compile_cache_dir={args.cache_dir}")
    trainers = {mode: build_trainer(load_benchmark_config(  # a bare process (tp1) is a world of one
        overrides + [f"model.compile={'true' if mode == 'compiled' else 'false'}"])) for mode in MODES}
    seconds = {mode: [] for mode in MODES}
    losses = {mode: [] for mode in MODES}
    for round_index in range(args.warmup + args.rounds):
        for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
            loss, elapsed = timed_step(trainers[mode])
            losses[mode].append(loss)
            seconds[mode].append(elapsed)
    for trainer in trainers.values():
        trainer.close()
    if dist.get_rank() == 0:
        write_json(layout_json(args.json, args.layout), summarize(args, seconds, losses))


def summarize(args, seconds: dict, losses: dict) -> dict:
    """Per mode the median timed step and tokens/s; the compiled/eager ratio; the first step (compilation)."""
    tokens = args.micro_batch * args.seq
    median = {mode: statistics.median(seconds[mode][args.warmup:]) for mode in MODES}
    deviation = [abs(c - e) / abs(e) for c, e in zip(losses["compiled"], losses["eager"])]
    return {"layout": args.layout, "args": vars(args), "seconds": seconds, "losses": losses, "median_s": median,
            "tokens_per_s": {mode: tokens / median[mode] for mode in MODES},
            "ratio": median["eager"] / median["compiled"],
            "first_step_s": {mode: seconds[mode][0] for mode in MODES},
            "loss_first_rel_deviation": deviation[0], "loss_max_rel_deviation": max(deviation)}


# ----- driver ------------------------------------------------------------------------------------
def report(results: list[dict]) -> str:
    a = results[0]["args"]
    rows = [[f"{r['layout']}{' Domino' if LAYOUTS[r['layout']] > 1 else ''}",
             f"{r['tokens_per_s']['eager']:.0f}", f"{r['tokens_per_s']['compiled']:.0f}", f"{r['ratio']:.3f}",
             f"{r['median_s']['eager'] * 1e3:.0f}", f"{r['median_s']['compiled'] * 1e3:.0f}",
             f"{r['first_step_s']['compiled']:.1f}",
             f"{r['loss_first_rel_deviation']:.0e} / {r['loss_max_rel_deviation']:.0e}"] for r in results]
    headers = ["layout", "eager tok/s", "compiled tok/s", "compiled/eager", "eager step ms", "compiled step ms",
               "1st compiled step s", "loss rel. diff: step 1 / max"]
    return "\n".join([
        f"torch.compile vs eager: {a['family']} hidden {a['hidden']}, heads {a['heads']}, layers {a['layers']}, "
        f"seq {a['seq']}, micro batch {a['micro_batch']}, vocab {a['vocab']}, {'bf16' if a['bf16'] else 'fp32'}, "
        f"AdamW, {a['threads']} thread(s) per rank; median of {a['rounds']} interleaved rounds after "
        f"{a['warmup']} warm-up",
        "",
        "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
        *("| " + " | ".join(row) + " |" for row in rows)])


def drive(args) -> None:
    results, flags = [], forward_flags(args, MODEL_FLAGS + ("family", "rounds", "warmup", "cache_dir", "json"))
    for layout in args.layouts.split(","):
        launch(os.path.abspath(__file__), LAYOUTS[layout], flags + ["--layout", layout])
        results.append(read_json(layout_json(args.json, layout)))
    print(report(results))
    print(f"results: {write_json(args.json, {'args': vars(args), 'layouts': results})}")


if __name__ == "__main__":
    run_harness(parse_args(), worker, drive)
