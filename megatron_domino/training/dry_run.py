"""``--dry-run``: check a launch on one CPU process before any GPU is asked for.

Validates the config for the world size, builds the rank grid (plain arithmetic, no process group,
no collective), and prints the rank map, the communication groups (tensor, context-parallel ring,
data, gradient, pipeline, embedding), the pipeline schedule's shape and the per-GPU memory estimate
of the configured layout. A 1024-GPU job is checked in a second on a login node; a layout that would
fail after 1024 ranks started fails here instead.

    python -m megatron_domino.training.dry_run --config configs/gpt/175b.yaml --world-size 1024 [key=value ...]
"""
from __future__ import annotations

import argparse
import sys

from ..config import ConfigError, load_config
from ..validation import validate_config
from ..config.schema import Config
from ..parallel.launch import launched_world_size
from ..parallel.topology import Topology
from ..pipeline.schedules import get, schedule_kind
from ..planner.hardware import get_gpu
from ..planner.memory import GIB, estimate_stages
from ..planner.muon import muon_balance

FULL_MAP_LIMIT = 32  # worlds up to this size print every rank
SHOWN = 8  # otherwise the first and last SHOWN ranks


def _node_span(groups: list[list[int]], gpus_per_node: int) -> str:
    inside = all(len({r // gpus_per_node for r in group}) == 1 for group in groups)
    return "each inside one node" if inside else "spanning nodes"


def _example(group: list[int]) -> str:
    shown = group if len(group) <= 8 else group[:4] + ["..."] + group[-2:]
    return "[" + ", ".join(map(str, shown)) + "]"


def _rank_map(topology: Topology, gpus_per_node: int) -> list[str]:
    hosts = [f"node{rank // gpus_per_node}/gpu{rank % gpus_per_node}" for rank in range(topology.world_size)]
    lines = topology.rank_map(hosts).splitlines()
    if topology.world_size <= FULL_MAP_LIMIT:
        return lines
    header, rows = lines[:2], lines[2:]
    return header + rows[:SHOWN] + [f"  ... {topology.world_size - 2 * SHOWN} ranks not shown ..."] + rows[-SHOWN:]


def _groups(topology: Topology, gpus_per_node: int) -> list[str]:
    """One line per kind of group; the gradient group (dp x cp) only when it differs from data parallel, the expert
    groups only under expert parallelism."""
    kinds = [("tensor parallel", topology.tp_groups()), ("context parallel (ring order)", topology.cp_groups()),
             ("data parallel", topology.dp_groups())]
    if topology.cp > 1:
        kinds.append(("gradients and ZeRO (data x context parallel)", topology.dp_cp_groups()))
    if topology.ep > 1 or topology.expert_tp != topology.tp:
        kinds += [("expert parallel (token all-to-all)", topology.expert_groups()),
                  ("expert gradients and ZeRO (expert replicas)", topology.expert_dp_groups())]
    kinds += [("pipeline (stage order)", topology.pp_groups()),
              ("embedding (first + last stage)", topology.embedding_groups())]
    lines = ["groups:"]
    for name, groups in kinds:
        lines.append(f"  {name}: {len(groups)} groups of {len(groups[0])}, {_node_span(groups, gpus_per_node)}; "
                     f"first {_example(groups[0])}")
    return lines


def _schedule(cfg: Config, dp: int, flights: list[int]) -> str:
    par = cfg.parallel
    kind = schedule_kind(par.pp, par.virtual_pp, par.pipeline_schedule)
    unit = "micro-batches" if get(kind).chunks == 1 else "chunk-micro-batches"
    split = (f" (each sequence split over {par.cp} context-parallel ranks, {cfg.model.seq_length // par.cp} tokens "
             f"each)" if par.cp > 1 else "")
    return (f"schedule: {kind}, {cfg.train.num_microbatches(dp)} micro-batches of {cfg.train.micro_batch_size} "
            f"per step on each of {dp} data-parallel replicas{split}; {unit} in flight: {flights[0]} on pipeline "
            f"rank 0, {flights[-1]} on the last")


_SHARDED = {0: "nothing sharded (gradients all-reduced)", 1: "optimizer state sharded",
            2: "optimizer state and gradients sharded", 3: "optimizer state, gradients and weights sharded"}


def _data_parallel(cfg: Config, dp: int) -> str:
    """What ZeRO shards over how many replicas, how ZeRO-3 gathers, and what is offloaded."""
    opt, replicas = cfg.optimizer, dp * cfg.parallel.cp
    line = f"ZeRO-{opt.zero_stage} over {replicas} replicas (dp x cp): {_SHARDED[opt.zero_stage]}"
    if opt.zero_stage == 3:
        line += (f"; each layer all-gathered before use with {opt.prefetch_depth} layer(s) prefetched, "
                 + ("released after its forward and gathered again for its backward" if opt.reshard_after_forward
                    else "kept gathered from forward to backward"))
    if opt.offload:
        line += f"; {opt.offload_fraction:.0%} of the optimizer shard offloaded to {opt.offload} memory"
    if (opt.master_dtype, opt.moments_dtype) != ("fp32", "fp32"):
        line += f"; masters {opt.master_dtype}" + (f" ({opt.master_rounding})" if opt.master_dtype == "bf16" else "")
        line += f", moments {opt.moments_dtype}"
    if opt.name == "muon":
        balance = muon_balance(cfg, dp)
        line += (f"\nMuon: Newton-Schulz {balance.total / 1e12:.1f} TFLOP per step ({opt.muon_ns_dtype}), each "
                 f"matrix on one owner; the busiest rank {max(balance.flops) / 1e12:.2f} TFLOP, "
                 f"{balance.ratio:.2f}x the mean")
    return line


def dry_run(cfg: Config, world_size: int, gpus_per_node: int = 8, gpu: str = "h100-80gb") -> str:
    """The dry-run report for ``cfg`` on ``world_size`` ranks; raises ``ConfigError`` for an invalid config."""
    notes = validate_config(cfg, world_size=world_size, check_paths=False)
    par = cfg.parallel
    topology = Topology.from_config(par, world_size)
    device = get_gpu(gpu)
    nodes = -(-world_size // gpus_per_node)
    lines = [f"dry run: {world_size} ranks on {nodes} node(s) x {gpus_per_node}; "
             f"no process group started, no collective run"]
    lines += [f"warning: {note}" for note in notes]
    lines += _rank_map(topology, gpus_per_node) + _groups(topology, gpus_per_node)
    stages = estimate_stages(cfg, topology.dp, device)
    lines.append(_schedule(cfg, topology.dp, [s.in_flight for s in stages]))
    lines.append(_data_parallel(cfg, topology.dp))
    worst = max(stages, key=lambda s: s.total)
    verdict = "fits" if worst.total <= device.memory_bytes else "DOES NOT FIT: run tools/plan.py for layouts that do"
    lines.append(f"memory per GPU ({device.name}, {device.memory_gib:.1f} GiB), worst pipeline rank {worst.rank}: "
                 f"{worst.breakdown()} -> {verdict}")
    if par.pp > 1:
        scale, unit = (GIB, "GiB") if worst.total >= GIB else (2**20, "MiB")
        lines.append(f"per pipeline rank ({unit}): " + ", ".join(f"{s.rank}: {s.total / scale:.1f}" for s in stages))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--world-size", type=int, default=launched_world_size(),
                        help="ranks of the launch (default: $WORLD_SIZE or $SLURM_NTASKS)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu", default="h100-80gb", help="GPU type for the memory estimate (see planner/hardware.py)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. parallel.tp=8")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.world_size is None:
        print("dry run: the world size is unknown. Fix: pass --world-size N or set WORLD_SIZE", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
        print(dry_run(cfg, args.world_size, args.gpus_per_node, args.gpu))
    except (ConfigError, ValueError) as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
