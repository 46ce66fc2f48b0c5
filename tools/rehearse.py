"""Rehearse a full-size training job on this CPU: every distinct rank role, two training steps each, on fake
CUDA devices and a fake process group at the real rank and world size (megatron_domino/rehearsal/).

    python tools/rehearse.py --config configs/llama/llama3-70b.yaml --world-size 64 [key=value ...]
        [--gpu h100-80gb] [--microbatches auto|full|N] [--ranks 0,8 | --stages all|outer] [--tolerance 0.10]
        [--json FILE]
    python tools/rehearse.py --all [--stages all|outer]   # every shipped config at its '# GPUs: N'

With --device cpu|cuda, each role runs for real instead: its share of the model on this device, real
kernels, and collectives that take the time --link gives them (megatron_domino/rehearsal/timed_rehearse.py):

    python tools/rehearse.py --config CFG --world-size N --device cuda --link dgx-h100 [--gpus-per-node 8]
        [--ranks R,...] [--steps 3] [--fake-json FILE] [key=value ...] --json FILE

(LINK: a preset, nvlink4, ib-ndr, nvlink3, ib-hdr, dgx-h100, dgx-a100, none; or GBPS,US; or NODE:NETWORK.)
It prints and writes per role the median step, the communication modelled and exposed per group, the peak
memory beside the planner's, the planner's step estimate and the job's step predicted from the measured
instructions (with MFU on CUDA); a role that does not fit the device is refused (exit 2) before it allocates.

Prints, per role: the peak device memory measured from the fake allocations (by category) beside the planner's
estimate, the pipeline instructions, the collectives and the host syncs of the steady-state step (--all: then the
table of benchmarks/reports/2026-12-04-rehearsal.md). Exits 1 when a steady-state step syncs with the host (other
than the by-design reads of docs/design/nccl-rules.md), when a peak is off the planner's estimate by more than
--tolerance, or when it does not fit the GPU; 2 when the rehearsal cannot run here (no C++ compiler to build the
fake device).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, ROOT)

from megatron_domino.rehearsal import fake_cuda  # noqa: E402 - imports no torch: it must load first

CONFIGS = os.path.join(ROOT, "configs")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config")
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--all", action="store_true", help="every config under configs/ that names its GPU count")
    parser.add_argument("--gpu", default=None, help="the GPU the planner and the fake device stand for (default: "
                        "h100-80gb; with --device cuda, this device's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="run each role for real on this device, with timed collectives")
    parser.add_argument("--link", default="dgx-h100", help="with --device: the links' model (see above)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="with --device: ranks per node")
    parser.add_argument("--steps", type=int, default=3, help="with --device: timed steps per role (median)")
    parser.add_argument("--fake-json", default=None, help="with --device: a fake rehearsal's --json of the same job, "
                        "whose peaks are shown beside the real ones")
    parser.add_argument("--microbatches", default="auto",
                        help="micro-batches per step: auto (fewest with the job's in-flight peak), full, or N")
    parser.add_argument("--ranks", default=None, help="comma-separated ranks instead of one per role")
    parser.add_argument("--stages", default="all", choices=("all", "outer"),
                        help="pipeline stages to rehearse: all, or the first two and the last")
    parser.add_argument("--tolerance", type=float, default=0.10, help="allowed |peak / planner - 1|")
    parser.add_argument("--json", default=None, help="write the result here (--all: a list of results)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args(argv)
    if args.all == bool(args.config or args.world_size):
        parser.error("give --config and --world-size, or --all")
    if args.device and args.all:
        parser.error("--device times one config: give --config and --world-size")
    if args.steps < 1:
        parser.error(f"--steps = {args.steps}: must be at least 1 (the median of the timed steps is reported)")
    return args


def timed(args) -> int:
    """--device: the real-device rehearsal with timed collectives."""
    from megatron_domino.config.errors import KnownError
    from megatron_domino.rehearsal.report import format_timed
    from megatron_domino.rehearsal.timed_rehearse import rehearse_timed
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    try:
        result = rehearse_timed(args.config, args.world_size, args.overrides, args.device, args.link,
                                args.gpus_per_node, ranks, args.stages, args.steps, args.microbatches, args.gpu)
    except KnownError as error:
        print(f"rehearse: {error}", file=sys.stderr)
        return 2
    if args.fake_json:
        with open(args.fake_json, encoding="utf-8") as f:
            fake = {role["rank"]: role["peak_memory_gib"] for role in json.load(f)["roles"]}
        for role in result["roles"]:
            role["fake_peak_memory_gib"] = fake.get(role["rank"])
    print(format_timed(result), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device:
        return timed(args)
    try:
        fake_cuda.load()
    except fake_cuda.FakeCudaUnavailable as reason:
        print(f"rehearse: cannot build the fake CUDA device here: {reason}", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
    from megatron_domino.config import ConfigError
    from megatron_domino.rehearsal.rehearse import rehearse
    from megatron_domino.rehearsal.report import format_result, markdown_rows, problems, sized_configs
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    jobs = sized_configs(CONFIGS).items() if args.all else [(args.config, args.world_size)]
    results, found = [], []
    for config, world_size in jobs:
        try:
            result = rehearse(config, world_size, args.overrides, args.microbatches, args.gpu or "h100-80gb", ranks,
                              args.stages)
        except ConfigError as error:
            print(f"rehearse: {error}", file=sys.stderr)
            return 2
        print(format_result(result), flush=True)
        results.append(result)
        found += problems(result, args.tolerance)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results if args.all else results[0], f, indent=1)
    if args.all:
        print("\n| config | GPUs | layout | stage | rehearsed GiB | planner GiB | diff |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(row for result in results for row in markdown_rows(result, CONFIGS)))
    for problem in found:
        print(f"FAILED: {problem}")
    print("rehearsal: " + ("FAILED" if found else "passed"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
