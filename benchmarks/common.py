"""What every harness shares: the benchmark GPT's config, launching ranks (optionally on a throttled link),
keeping several Trainers alive in one process group, and the printed table / JSON output.

Each harness is one script that is both the driver (run it plainly: it starts its own torchrun jobs, inside
``throttled.sh`` when a link rate is given) and the worker (``--worker``, what those jobs run), so a clean
clone measures everything with one command.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # a clean clone need not be pip-installed
    sys.path.insert(0, REPO)

RESULTS = os.path.join(REPO, "benchmarks", "results")
BASE_CONFIG = os.path.join(REPO, "configs", "tiny", "gpt.yaml")
NETEM = os.path.join(REPO, "benchmarks", "throttled.sh")  # the throttled-loopback runner
# Synthetic tokens (no corpus), no files beyond the run directory, no dropout (timings must not depend on masks).
COMMON_OVERRIDES = ["data.mock=true", "tokenizer.type=NullTokenizer", "tokenizer.model=null",
                    "log.tensorboard=false", "checkpoint.dir=null", "checkpoint.save_at_end=false",
                    "model.attention_dropout=0.0", "model.hidden_dropout=0.0", "model.ffn_hidden_size=null",
                    "optimizer.warmup_steps=0", "train.steps=100000"]


def add_model_args(parser, *, hidden: int, heads: int, layers: int, seq: int, micro_batch: int,
                   vocab: int = 1024, bf16: bool = False) -> None:
    group = parser.add_argument_group("model (a GPT: learned positions, LayerNorm, GeLU MLP of 4h, tied head)")
    group.add_argument("--hidden", type=int, default=hidden)
    group.add_argument("--heads", type=int, default=heads)
    group.add_argument("--layers", type=int, default=layers)
    group.add_argument("--seq", type=int, default=seq)
    group.add_argument("--micro-batch", type=int, default=micro_batch)
    group.add_argument("--vocab", type=int, default=vocab)
    group.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=bf16,
                       help=f"bf16 weights and activations, fp32 masters (default {'bf16' if bf16 else 'fp32'})")
    group.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1: 2 shared cores)")


MODEL_FLAGS = ("hidden", "heads", "layers", "seq", "micro_batch", "vocab", "bf16", "threads")


def model_overrides(args, run_name: str) -> list[str]:
    """Config overrides for the benchmark GPT described by ``args`` (see add_model_args)."""
    return COMMON_OVERRIDES + [
        f"model.hidden_size={args.hidden}", f"model.num_attention_heads={args.heads}",
        f"model.num_layers={args.layers}", f"model.seq_length={args.seq}",
        f"model.max_position_embeddings={args.seq}", f"model.vocab_size={args.vocab}",
        f"train.micro_batch_size={args.micro_batch}", f"train.bf16={'true' if args.bf16 else 'false'}",
        f"log.dir={os.path.join(REPO, 'runs', 'benchmarks', run_name)}"]


def add_throttled_job_args(parser, name: str) -> None:
    """A driver's --netem and --json (results/NAME.json), and the flags only its jobs get: --worker, --rate."""
    parser.add_argument("--netem", default=NETEM, help="path of throttled.sh")
    parser.add_argument("--json", default=os.path.join(RESULTS, f"{name}.json"), help="where results go")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rate", default="none", help=argparse.SUPPRESS)


def add_rotating_rounds_args(parser, *, rates: str, rounds: int, warmup: int) -> None:
    """--rates, --rounds and --warmup of a harness that runs its modes once per round (``rotating_rounds``)."""
    parser.add_argument("--rates", default=rates, help="comma-separated link rates; none: raw loopback")
    parser.add_argument("--rounds", type=int, default=rounds, help="timed rounds (every mode once each)")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed rounds first")


def rotating_rounds(modes, rounds: int, warmup: int, run) -> dict:
    """{mode: [run(mode) of each timed round]}: every mode once per round, in an order that rotates from round to
    round so that drift hits the modes alike."""
    timings = {mode: [] for mode in modes}
    for round_index in range(warmup + rounds):
        turn = round_index % len(modes)
        for mode in modes[turn:] + modes[:turn]:
            result = run(mode)
            if round_index >= warmup:
                timings[mode].append(result)
    return timings


def write_median_times(path: str, args, timings: dict) -> None:
    """Gather each rank's ``rotating_rounds`` timings of (seconds, seconds blocked) and, on rank 0, write their
    medians to ``path``: ``pass_s`` the slower rank's per round, ``waits_s`` over every rank and round."""
    import torch.distributed as dist
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, timings)
    if dist.get_rank() == 0:
        rounds = range(args.rounds)
        write_json(path, {"args": vars(args), "pass_s": {
            mode: statistics.median(max(r[mode][k][0] for r in everyone) for k in rounds) for mode in timings},
            "waits_s": {mode: statistics.median(r[mode][k][1] for r in everyone for k in rounds) for mode in timings}})


def median_rows(data: dict, modes, baseline: str) -> list[list[str]]:
    """Table rows of ``write_median_times``' data: per mode its pass in ms, its ratio to ``baseline``'s and its
    time blocked in waits less the ``nocomm`` mode's."""
    passes, waits = data["pass_s"], data["waits_s"]
    return [[mode, f"{passes[mode] * 1e3:.1f}", f"{passes[mode] / passes[baseline]:.2f}",
             f"{(waits[mode] - waits['nocomm']) * 1e3:.1f}"] for mode in modes]


def drive_rates(args, script: str, nproc: int, flags: list[str], report) -> None:
    """One job of ``script`` per link rate in ``args.rates`` (``none``: the raw loopback), each writing its JSON
    next to ``args.json``; prints ``report(rate, data)`` of each."""
    base, ext = os.path.splitext(args.json)
    reports = []
    for rate in args.rates.split(","):
        path = f"{base}-{rate}{ext}"
        launch(os.path.abspath(script), nproc, flags + ["--json", path], rate=None if rate == "none" else rate,
               netem=args.netem)
        reports.append(report(rate, read_json(path)))
    print("\n\n".join(reports))


def load_benchmark_config(overrides: list[str]):
    from megatron_domino.config import load_config
    return load_config(BASE_CONFIG, overrides)


def forward_flags(args, names) -> list[str]:
    """``args``' values of ``names`` as command-line flags again (driver -> worker)."""
    flags = []
    for name in names:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


# ----- launching ----------------------------------------------------------------------------------
def launch(script: str, nproc: int, flags: list[str], rate: str | None = None, netem: str = NETEM,
           timeout: float | None = None) -> None:
    """Run ``script --worker flags`` on ``nproc`` ranks (torchrun; a bare process for 1), on a loopback
    throttled to ``rate`` (e.g. "1gbit") when given. Output streams through; a failure raises."""
    command = [sys.executable, script, "--worker", *flags]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   script, "--worker", *flags]
    if rate:
        if not os.path.exists(netem):
            raise SystemExit(f"--netem {netem}: not found. Fix: pass the path of benchmarks/throttled.sh, "
                             f"or --rates none to run on the raw loopback (no overlap can be seen there).")
        command = ["bash", netem, "--rate", rate, "--", *command]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    print(f"$ {shlex.join(command)}", flush=True)
    result = subprocess.run(command, cwd=REPO, env=env, timeout=timeout)
    if result.returncode != 0:
        raise SystemExit(f"benchmark job failed with status {result.returncode}: {shlex.join(command)}")


# ----- Trainers, quietly --------------------------------------------------------------------------
def build_trainer(cfg, quiet: bool = True):
    """A Trainer without its rank-map printout. Each Trainer owns its ParallelState (the library keeps no
    current one), so a harness may hold one per mode in one process group; ``trainer.close()`` frees its groups."""
    from megatron_domino.training.trainer import Trainer
    quieted = contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext()
    with quieted:
        return Trainer(cfg)


# ----- output -------------------------------------------------------------------------------------
@contextlib.contextmanager
def tp_communication_skipped(group):
    """Every all-reduce and reduce-scatter on ``group`` does nothing (results become wrong): the "no
    communication" bound that Domino is compared with. The library treats a None handle as complete."""
    import torch.distributed as dist
    names = [n for n in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single") if hasattr(dist, n)]
    originals = {name: getattr(dist, name) for name in names}

    def skipping(name):
        position = 2 if name == "all_reduce" else 3  # of ``group`` in the positional signature

        def call(*args, **kwargs):
            target = kwargs["group"] if "group" in kwargs else (args[position] if len(args) > position else None)
            if target is not group:
                return originals[name](*args, **kwargs)
            if name != "all_reduce":  # the output of a skipped reduce-scatter: zeros, not garbage
                (kwargs["output"] if "output" in kwargs else args[0]).zero_()
            return None
        return call

    for name in names:
        setattr(dist, name, skipping(name))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


def format_table(headers: list[str], rows: list[list]) -> str:
    """A right-aligned text table (first column left-aligned); floats are printed as given by the caller."""
    cells = [[str(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for index, row in enumerate(cells):
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(parts).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str, data) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    return path


def read_json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def run_harness(args, worker, drive) -> None:
    """A harness script is both the driver (launches its jobs) and, with --worker, one rank of a job."""
    if args.worker:
        from megatron_domino.parallel.launch import shutdown_distributed
        worker(args)
        shutdown_distributed()
    else:
        drive(args)
