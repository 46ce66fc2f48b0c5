"""DualPipeV's F&B unit, its halves in turns (``parallel.overlap_f_and_b``, ``parallel/turns.py``) against in
sequence, on a throttled link, beside the same unit without TP communication (the bound).

    python benchmarks/f_and_b.py                       # tp 2 and ep 2; 1gbit, 2gbit and the raw loopback
    python benchmarks/f_and_b.py --layouts ep2 --rates 500mbit --hidden 512 --seq 256

The unit alone, at tp 2 with Domino (row split, 2 μ-chunks) or, for an MoE (4 experts, top 2, dropless), at ep 2
without TP: one torchrun job of 2 ranks per layout and link rate (inside
``benchmarks/throttled.sh``, so transfers wait on a "wire" while the cores compute: one core per rank, as on a
GPU where compute and NCCL's transfers run side by side). Its pipeline neighbours would only add the unit's
receives before it and its sends after it, so they are left out: at tp 2 x pp 2 on these 2 cores the 4 ranks
would share the cores, and a rank's exposed wait would only give its core to another rank. Each round runs
the forward of micro-batch A and the backward of micro-batch B (whose forward ran before the round, untimed)
in each mode, in an order that rotates from round to round so that drift hits every mode alike:
  sequence  the forward, then the backward: the last μ-chunk's all-reduce of every phase is waited for with
            nothing to hide behind;
  turns     the forward on a helper thread, handing the turn to the backward before each Domino wait, the
            backward handing it back before each input-gradient wait;
            (at ep 2, each half hands over while its experts' rows travel, dispatch and combine);
  nocomm    turns with every TP all-reduce and reduce-scatter skipped (wrong numbers, the bound; tp 2 only: the
            experts' exchange cannot be skipped, it decides which rows a rank computes).
Medians over the rounds of the slower rank's unit time, exposed = (mode - nocomm) / mode, and of a rank's time
blocked in waits (tp 2: Domino's, the forward's row-parallel reduces and the backward's input-gradient reduces,
less nocomm's, what those calls cost without communication; ep 2: the waits for the experts' rows): the
communication the unit could not hide.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

from common import (MODEL_FLAGS, add_model_args, add_rotating_rounds_args, add_throttled_job_args, build_trainer,
                    format_table, forward_flags, launch, load_benchmark_config, model_overrides, read_json,
                    rotating_rounds, run_harness, tp_communication_skipped, write_json)

MODES = {"tp2": ("turns", "sequence", "nocomm"), "ep2": ("turns", "sequence")}
LAYOUTS = {"tp2": ["parallel.tp=2", "parallel.domino=true", "parallel.domino_chunks=2"],
           "ep2": ["parallel.ep=2", "model.num_experts=4", "model.moe_topk=2", "model.moe_capacity_factor=null",
                   "model.moe_aux_loss_coeff=0.0"]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=512, heads=8, layers=4, seq=256, micro_batch=2)
    parser.add_argument("--layouts", default="tp2,ep2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    add_rotating_rounds_args(parser, rates="1gbit,2gbit,none", rounds=9, warmup=2)
    add_throttled_job_args(parser, "f_and_b")
    args = parser.parse_args(argv)
    for name in args.layouts.split(","):
        if name not in LAYOUTS:
            parser.error(f"--layouts: {name!r} is not one of {', '.join(LAYOUTS)}")
    return args


def _batch(args, seed: int) -> dict:
    import torch
    g = torch.Generator().manual_seed(seed)
    shape = (args.micro_batch, args.seq)
    return {"tokens": torch.randint(0, args.vocab, shape, generator=g),
            "labels": torch.randint(0, args.vocab, shape, generator=g)}


@contextlib.contextmanager
def blocked_in_waits(seconds: list):
    """Add to ``seconds[0]`` the time spent waiting for communication: Domino's waits (the forward's row-parallel
    reduces, ``PendingReduce.wait``; the backward's input-gradient reduces, ``PendingInputGradient.finish``) and
    the waits of asynchronous all-to-alls (the experts' rows)."""
    import torch.distributed as dist
    from megatron_domino.tensor_parallel import async_comm
    originals = {cls: cls.__dict__[name] for cls, name in ((async_comm.PendingReduce, "wait"),
                                                          (async_comm.PendingInputGradient, "finish"))}
    all_to_all = dist.all_to_all_single

    def timed(function):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[0] += time.perf_counter() - start
        return call

    class TimedWork:
        def __init__(self, work):
            self.wait = timed(work.wait)

    def exchange(*args, async_op=False, **kwargs):
        work = all_to_all(*args, async_op=async_op, **kwargs)
        return TimedWork(work) if async_op else work
    for cls, function in originals.items():
        setattr(cls, function.__name__, timed(function))
    dist.all_to_all_single = exchange
    try:
        yield
    finally:
        for cls, function in originals.items():
            setattr(cls, function.__name__, function)
        dist.all_to_all_single = all_to_all


def _unit(trainer, mode: str, batch_a: dict, batch_b: dict) -> tuple[float, float]:
    """(seconds, seconds blocked in Domino's waits) of one F&B unit: the forward of ``batch_a`` and the backward
    of ``batch_b`` (whose forward runs first, untimed)."""
    import torch
    import torch.distributed as dist
    from megatron_domino.parallel.turns import Turns
    from megatron_domino.pipeline.split_backward import run_backward
    chunk, held, blocked = trainer.chunks[0], {}, [0.0]
    trainer.optimizer.zero_grad()
    loss_b = chunk(None, batch_b).sum()
    skipped = tp_communication_skipped(trainer.state.tp_group) if mode == "nocomm" else contextlib.nullcontext()
    forward = lambda: held.__setitem__("a", chunk(None, batch_a))  # noqa: E731
    backward = lambda: run_backward(loss_b, None)  # noqa: E731
    dist.barrier()
    with skipped, blocked_in_waits(blocked):
        start = time.perf_counter()
        if mode == "sequence":
            forward()
            backward()
        else:
            Turns(torch.device("cpu")).run(forward, backward, trainer.state.turns)
        return time.perf_counter() - start, blocked[0]


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(args.threads)
    layout, modes = args.layouts, MODES[args.layouts]  # a job runs one layout
    dp = 2 if layout == "ep2" else 1
    overrides = model_overrides(args, f"f_and_b/{layout}") + LAYOUTS[layout] + [
        "optimizer.overlap_grad_reduce=false", f"train.global_batch_size={args.micro_batch * dp}"]
    trainer = build_trainer(load_benchmark_config(overrides))
    rank = dist.get_rank() * dp // 2  # ep 2: each rank routes its own tokens
    batch_a, batch_b = _batch(args, 1 + 2 * rank), _batch(args, 2 + 2 * rank)
    timings = rotating_rounds(modes, args.rounds, args.warmup, lambda mode: _unit(trainer, mode, batch_a, batch_b))
    trainer.close()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, timings)
    if dist.get_rank() == 0:
        rounds = range(args.rounds)
        write_json(args.json, {"args": vars(args), "unit_s": {
            mode: statistics.median(max(rank[mode][k][0] for rank in everyone) for k in rounds) for mode in modes},
            "waits_s": {mode: statistics.median(rank[mode][k][1] for rank in everyone for k in rounds)
                        for mode in modes}})


def report(layout: str, rate: str, data: dict) -> str:
    a, unit, waits = data["args"], data["unit_s"], data["waits_s"]
    bound = unit.get("nocomm")
    rows = [[mode, f"{unit[mode] * 1e3:.1f}", f"{unit[mode] / unit['sequence']:.2f}",
             f"{(unit[mode] - bound) / unit[mode]:.0%}" if bound else "-",
             f"{(waits[mode] - waits.get('nocomm', 0.0)) * 1e3:.1f}"] for mode in MODES[layout]]
    where = ("tp 2, Domino row split (2 μ-chunks)" if layout == "tp2" else
             "ep 2 (dp 2, no TP), 4 experts, top 2, dropless")
    return "\n".join([
        f"{layout}, link {rate}: F&B unit of a GPT (hidden {a['hidden']}, layers {a['layers']}, seq {a['seq']}, "
        f"micro batch {a['micro_batch']}), {where}; median of {a['rounds']} rounds",
        format_table(["mode", "unit ms", "/ sequence", "exposed", "blocked ms"], rows)])


def drive(args) -> None:
    flags = forward_flags(args, MODEL_FLAGS + ("rounds", "warmup"))
    base, ext = os.path.splitext(args.json)
    reports = []
    for layout in args.layouts.split(","):
        for rate in args.rates.split(","):
            path = f"{base}-{layout}-{rate}{ext}"
            launch(os.path.abspath(__file__), 2, flags + ["--layouts", layout, "--json", path],
                   rate=None if rate == "none" else rate, netem=args.netem)
            reports.append(report(layout, rate, read_json(path)))
    print("\n\n".join(reports))


if __name__ == "__main__":
    run_harness(parse_args(), worker, drive)
