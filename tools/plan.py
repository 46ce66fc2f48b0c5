"""The parallelism planner: every valid (tp, cp, pp, dp, virtual pp, pipeline schedule, micro batch, recompute, ZeRO,
TP and CP communication) layout for a cluster, with its per-GPU memory and step time, ranked fastest first among those
that fit.

    python tools/plan.py --model gpt3-175b --gpu h100-80gb --nodes 16 --gpus-per-node 8
        [--seq-length 2048] [--global-batch 1536] [--top 10] [--emit] [--tp 8] [--cp 1,2] [--pp 8,16] [--ep 1,4]
        [--cp-comm ring,a2a,a2a+ring] [--schedule 1f1b,zb-h1,interleaved,zb-v,dualpipev]
        [key=value ...]

--model takes a config file or a size name (gpt3-175b, llama2-70b, tiny-gpt, ... as listed by --help). --ep (MoE
models only) pins the expert-parallel sizes as --cp pins cp. --schedule keeps the pipelined layouts that run one of
these schedules (a config or override setting parallel.pipeline_schedule fixes it instead). --emit prints only the
best layout, as overrides for pretrain_gpt.py / pretrain_llama.py. The assumptions behind the numbers are in
megatron_domino/planner/{memory,timing,context_parallel,moe}.py.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, ROOT)

from megatron_domino.config import ConfigError, load_config  # noqa: E402
from megatron_domino.config.schema import CP_COMMS  # noqa: E402
from megatron_domino.pipeline.schedules import names as schedule_names  # noqa: E402
from megatron_domino.models.counters import count_parameters  # noqa: E402
from megatron_domino.planner.hardware import GPUS, get_gpu  # noqa: E402
from megatron_domino.planner.report import format_table  # noqa: E402
from megatron_domino.planner.search import candidate_layouts, divisors, first_valid, rank_layouts  # noqa: E402
from megatron_domino.planner.timing import TimingAssumptions  # noqa: E402

_FAMILY_PREFIX = {"gpt": "gpt3-", "llama": "", "tiny": "tiny-"}


def model_names() -> dict[str, str]:
    """Size name -> config file: configs/gpt/175b.yaml is gpt3-175b, configs/llama/llama2-70b.yaml llama2-70b."""
    names = {}
    for family, prefix in _FAMILY_PREFIX.items():
        for path in sorted(glob.glob(os.path.join(ROOT, "configs", family, "*.yaml"))):
            stem = os.path.splitext(os.path.basename(path))[0]
            if stem != "base":
                names[prefix + stem] = path
    return names


def resolve_model(text: str) -> str:
    if os.path.isfile(text):
        return text
    names = model_names()
    if text.lower() in names:
        return names[text.lower()]
    raise ConfigError("--model", text, "is neither a config file nor a known size name",
                      f"give a path, or one of {', '.join(names)}")


def _count(text: str, least: int = 1) -> int:
    """An integer size, refused by argparse below ``least`` (a cluster of 0 nodes has no layout to rank)."""
    value = int(text)
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {least} or more, got {value}")
    return value


def _cp_comm(text: str) -> str:
    if text not in CP_COMMS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(CP_COMMS)}")
    return text


def _schedule(text: str) -> str:
    if text not in schedule_names():
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(schedule_names())}")
    return text


def _list(kind):
    return lambda text: [kind(item) for item in text.split(",")]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="size names: " + ", ".join(model_names()))
    p.add_argument("--model", required=True, help="config file or size name")
    p.add_argument("--gpu", default="h100-80gb", help=f"one of {', '.join(GPUS)}")
    p.add_argument("--nodes", type=_count, default=1)
    p.add_argument("--gpus-per-node", type=_count, default=8)
    p.add_argument("--seq-length", type=_count, help="default: the config's model.seq_length")
    p.add_argument("--global-batch", type=_count, help="default: the config's train.global_batch_size")
    p.add_argument("--top", type=_count, default=10, help="rows to print")
    p.add_argument("--emit", action="store_true", help="print the best layout as config overrides and exit")
    p.add_argument("--efficiency", type=float, default=TimingAssumptions.efficiency,
                   help="achieved share of peak FLOP/s")
    p.add_argument("--domino-hidden", type=float, default=TimingAssumptions.domino_hidden,
                   help="share of TP communication Domino's row split hides")
    p.add_argument("--domino-column-hidden", type=float, default=TimingAssumptions.domino_column_hidden,
                   help="share the column split hides (what micro batch 1 runs)")
    p.add_argument("--a2a-hidden", type=float, default=TimingAssumptions.a2a_hidden,
                   help="share of context parallelism's all-to-alls hidden behind compute")
    p.add_argument("--overhead-gib", type=float, help="fixed per-GPU overhead (default: the GPU's entry)")
    p.add_argument("--tp", type=_list(_count), help="only these tp sizes (comma-separated)")
    p.add_argument("--cp", type=_list(_count), help="only these context-parallel sizes")
    p.add_argument("--pp", type=_list(_count), help="only these pp sizes")
    p.add_argument("--ep", type=_list(_count), help="only these expert-parallel sizes (MoE models)")
    p.add_argument("--vpp", type=_list(_count), help="only these virtual pp sizes")
    p.add_argument("--mbs", type=_list(_count), help="only these micro batch sizes")
    p.add_argument("--recompute", type=_list(str), help="only these: none,selective,full")
    p.add_argument("--zero", type=_list(lambda text: _count(text, least=0)), help="only these ZeRO stages")
    p.add_argument("--tp-comm", type=_list(str), help="only these: domino,sp")
    p.add_argument("--cp-comm", type=_list(_cp_comm), help="only these for cp > 1: ring,a2a,a2a+ring")
    p.add_argument("--schedule", type=_list(_schedule),
                   help="only pp > 1 layouts running these: 1f1b,interleaved,zb-h1,zb-v,dualpipev")
    p.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    return p.parse_args(argv)


def _filters(args) -> dict:
    only = {"tp": args.tp, "cp": args.cp, "pp": args.pp, "ep": args.ep, "virtual_pp": args.vpp, "micro_batch": args.mbs,
            "recompute": args.recompute, "zero_stage": args.zero, "cp_comm": args.cp_comm, "schedule": args.schedule}
    only = {key: value for key, value in only.items() if value is not None}
    if args.tp_comm is not None:
        only["sequence_parallel"] = {mode == "sp" for mode in args.tp_comm}
    return only


def check_ep(cfg, eps: list[int]) -> None:
    """Refuse an ``--ep`` no layout of this model can have: it must divide model.num_experts (and a data-parallel
    size: checked after the search), as ``config/validate_moe.py`` requires of parallel.ep."""
    experts = cfg.model.num_experts or 0
    for ep in eps:
        if ep > 1 and not experts:
            raise ConfigError("--ep", ep, "expert parallelism needs experts (model.num_experts is unset)",
                              "drop --ep, or plan an MoE model (model.num_experts=N)")
        if experts % ep:
            raise ConfigError("--ep", ep, f"must divide model.num_experts = {experts} (each expert-parallel rank "
                              "holds num_experts / ep experts)", f"use one of {divisors(experts)}")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        path = resolve_model(args.model)
        cfg = load_config(path, args.overrides)
        extra = []
        if args.seq_length is not None:
            extra.append(f"model.seq_length={args.seq_length}")
            if cfg.model.position_embedding == "learned" and args.seq_length > cfg.model.max_positions:
                extra.append(f"model.max_position_embeddings={args.seq_length}")  # a longer learned table
        if args.global_batch is not None:
            extra.append(f"train.global_batch_size={args.global_batch}")
        cfg = load_config(path, [*args.overrides, *extra])
        gpu = get_gpu(args.gpu).with_overhead(args.overhead_gib)
        check_ep(cfg, args.ep or [])
    except (ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    assumptions = TimingAssumptions(args.efficiency, args.domino_hidden, args.domino_column_hidden,
                                    a2a_hidden=args.a2a_hidden)
    estimates = rank_layouts(cfg, gpu, args.nodes, args.gpus_per_node, assumptions, _filters(args))
    world = args.nodes * args.gpus_per_node
    if args.ep and not estimates and candidate_layouts(cfg, world, {**_filters(args), "ep": divisors(world)}):
        value = args.ep[0] if len(args.ep) == 1 else args.ep
        error = ConfigError("--ep", value, "must divide the data-parallel size (expert ranks are data-parallel "
                            f"ranks), and no valid layout of {world} GPUs with the other options has such a dp",
                            "lower --ep, or pin --tp/--cp/--pp so that GPUs / (tp*cp*pp) is a multiple of it")
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.emit:
        best = first_valid(cfg, (e for e in estimates if e.fits), 1)
        if not best:
            print("error: no valid layout fits in memory; run without --emit to see the nearest misses",
                  file=sys.stderr)
            return 1
        print(" ".join(best[0].layout.overrides()))
        return 0
    size = lambda n: f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"  # noqa: E731
    params = size(count_parameters(cfg.model))
    if cfg.model.num_experts:
        params += (f" ({size(count_parameters(cfg.model, active=True))} active: top-{cfg.model.moe_topk} of "
                   f"{cfg.model.num_experts} experts)")
    print(f"model {os.path.relpath(path, ROOT)}: {params} parameters, "
          f"seq {cfg.model.seq_length}, global batch {cfg.train.global_batch_size}, "
          f"{'bf16' if cfg.train.bf16 else 'fp16' if cfg.train.fp16 else 'fp32'}")
    print(f"cluster: {world} x {gpu.name} ({args.nodes} nodes x {args.gpus_per_node}), "
          f"{gpu.memory_gib:.1f} GiB each, {gpu.overhead_gib:.1f} GiB overhead; "
          f"efficiency {assumptions.efficiency:.2f}, "
          f"Domino hides {assumptions.domino_hidden:.2f} (row) / {assumptions.domino_column_hidden:.2f} (column)")
    print(format_table(estimates, first_valid(cfg, estimates, args.top), moe=bool(cfg.model.num_experts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
