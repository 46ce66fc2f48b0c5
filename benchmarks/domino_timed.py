"""Domino against synchronous TP on one device playing rank 0 of a TP group, with link-timed collectives.

One process, no torchrun: the timed process group (megatron_domino/rehearsal/timed_group.py) stands in for
NCCL at the real TP size, so one GPU (or this CPU) computes rank 0's real share of a model slice while every
all-reduce and reduce-scatter takes the time the link model gives it, on a stream of its own (CUDA) or as a
host deadline (CPU). Per case (model slice x tp x link x sequence parallelism), every mode of Domino
(``domino.plan.COMPARED_PLANS``) beside the no-communication bound (the same sync run on a link that takes no
time: the values are still written):

    python benchmarks/domino_timed.py --device cuda --models llama3-70b,gpt3-175b --tp 2,4,8 --sp off,on
    python benchmarks/domino_timed.py --device cuda --models llama3-70b --tp 8 --nodes 2 --link dgx-h100
    python benchmarks/domino_timed.py --device cpu --models cpu --tp 4 --comm-share 0.4    # the CPU check

speed-up = T_sync / T_mode; hidden = (T_sync - T_mode) / (T_sync - T_nocomm), the share of sync TP's exposed
communication the mode hides; comm share = (T_sync - T_nocomm) / T_sync; hidden (waits) = 1 - E_mode / E_sync,
E the time the rank stood at communication waits (measured by the timed group: exact on the CPU, CUDA events
on a GPU), which step-to-step compute noise cannot blur. ``--nodes 2`` spreads the TP group
over two nodes (gpus per node = tp / 2), so its collectives take the network. ``--comm-share S`` picks the
link (bandwidth, no latency) at which sync TP spends S of its step communicating, from a nocomm step and the
modelled bytes (the CPU check: S = 0.4). Modes run one after another on CUDA (a slice's memory each) and in
rotating rounds on the CPU (drift hits all alike); medians of --steps steps.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import common  # noqa: F401 - puts the repository on sys.path
from common import format_table, rotating_rounds, write_json, RESULTS

from megatron_domino.domino.plan import COMPARED_PLANS

CONFIGS = os.path.join(common.REPO, "configs")
# a slice of each model: its config, the layers kept, micro batch and sequence (the row split needs >= 2 samples)
MODELS = {"llama3-70b": ("llama/llama3-70b.yaml", 4, 2, 4096),
          "gpt3-175b": ("gpt/175b.yaml", 2, 2, 2048),
          "cpu": ("tiny/gpt.yaml", 4, 4, 256)}
CPU_SHAPE = ["model.hidden_size=512", "model.num_attention_heads=8", "model.ffn_hidden_size=2048",
             "model.max_position_embeddings=256", "model.vocab_size=1024"]
MODES = {name: plan.overrides() for name, plan in COMPARED_PLANS.items()}
MODES["nocomm"] = COMPARED_PLANS["sync"].overrides()  # on a link that takes no time
MODES["megatron-core"] = COMPARED_PLANS["sync"].overrides()  # its GPTModel, local spec: GPT-shaped models only


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--models", default="cpu", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--tp", default="4", help="comma-separated TP sizes")
    parser.add_argument("--sp", default="off", help="sequence parallelism: off, on or off,on")
    parser.add_argument("--link", default="nvlink4", help="a link preset or GBPS,US (rehearsal/links.py)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the TP group spans (1 or 2)")
    parser.add_argument("--comm-share", type=float, default=None, help="pick the link for this sync comm share")
    parser.add_argument("--layers", type=int, default=None, help="layers of the slice (default: the model's)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated; sync and nocomm required")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    parser.add_argument("--json", default=os.path.join(RESULTS, "domino_timed.json"))
    parser.add_argument("overrides", nargs="*", help="config overrides for every case")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not {"sync", "nocomm"} <= set(modes) or set(modes) - set(MODES):
        parser.error(f"--modes {args.modes}: pick from {','.join(MODES)}, with sync and nocomm (the ratios need them)")
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        parser.error(f"--models: {unknown} unknown. Fix: pick from {', '.join(MODELS)}")
    if args.nodes not in (1, 2):
        parser.error(f"--nodes = {args.nodes}: 1 (NVLink inside a node) or 2 (the TP group across two nodes)")
    return args


def case_config(args, model: str, tp: int, sp: bool, mode: str, logs: str):
    from megatron_domino.config.loader import load_config
    from megatron_domino.rehearsal.rehearse import DEFAULTS
    from megatron_domino.rehearsal.timed_rehearse import fixed_settings
    path, layers, micro, seq = MODELS[model]
    shape = (CPU_SHAPE if model == "cpu" else []) + [
        f"model.num_layers={args.layers or layers}", f"model.seq_length={seq}", f"parallel.tp={tp}",
        "parallel.pp=1", "parallel.dp=1", "parallel.cp=1", "parallel.virtual_pp=1", "parallel.ep=1",
        "parallel.pipeline_schedule=null", f"parallel.sequence_parallel={str(sp).lower()}",
        f"train.micro_batch_size={micro}", f"train.global_batch_size={micro}", "optimizer.zero_stage=1",
        f"train.bf16={'true' if args.device == 'cuda' else 'false'}", "model.recompute=none",
        "model.attention_dropout=0.0", "model.hidden_dropout=0.0", f"log.dir={logs}"]
    return load_config(os.path.join(CONFIGS, path), [*DEFAULTS, *shape, *MODES[mode], *args.overrides,
                                                     *fixed_settings(args.device)])


class Runner:
    """One mode's training step: our Trainer's, or megatron-core's GPTModel's (``megatron_core_gpt.py``)."""

    def __init__(self, cfg, mode: str, device):
        from megatron_domino.training.trainer import Trainer
        self.device, self.index = device, 0
        if mode == "megatron-core":
            import megatron_core_gpt as mcore
            model, optimizer, _ = mcore.build(cfg, device)
            self.step, self.close = mcore.make_step(cfg, model, optimizer, device), lambda: None
        else:
            trainer = Trainer(cfg, writes_checkpoints=False, print_rank_map=False)
            self.step, self.close = (lambda index: trainer.train_step()), trainer.close


def timed_step(runner: Runner, timed, links, mode: str) -> tuple[float, float, float]:
    """(seconds, seconds exposed at communication waits, seconds of communication modelled) of one step."""
    from megatron_domino.parallel.device import cuda
    from megatron_domino.rehearsal.links import LinkModel
    timed.links = LinkModel.parse("none") if mode == "nocomm" else links
    timed.exposure.take()
    begin = time.perf_counter()
    runner.step(runner.index)
    runner.index += 1
    if runner.device.type == "cuda":
        cuda.synchronize(runner.device)
    seconds = time.perf_counter() - begin
    modelled, exposed, _ = timed.exposure.take()
    return seconds, sum(exposed.values()), sum(modelled.values())


def calibrated_link(trainers: dict, timed, args) -> str:
    """The link (GB/s, no latency) at which sync spends ``args.comm_share`` of its step communicating."""
    from megatron_domino.rehearsal.links import LinkModel
    reference = LinkModel.parse("1,0", timed.links.gpus_per_node)
    for _ in range(args.warmup):
        timed_step(trainers["nocomm"], timed, reference, "nocomm")
    free = statistics.median(timed_step(trainers["nocomm"], timed, reference, "nocomm")[0]
                             for _ in range(args.steps))
    modelled = timed_step(trainers["sync"], timed, reference, "sync")[2]  # seconds at 1 GB/s
    wanted = free * args.comm_share / (1 - args.comm_share)
    return f"{modelled / wanted:.6g},0"


def run_case(args, model: str, tp: int, sp: bool) -> dict:
    import torch
    import torch.distributed as dist
    from megatron_domino.rehearsal.links import LinkModel
    from megatron_domino.rehearsal.store import RehearsalStore
    from megatron_domino.rehearsal.timed_group import TimedJob, backend_name, register
    from megatron_domino.training.checkpoint_dir import RUN_DIRS_VERDICT
    register()
    per_node = tp // args.nodes
    os.environ.update(RANK="0", WORLD_SIZE=str(tp), LOCAL_RANK="0")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    links = LinkModel.parse(args.link, per_node)
    timed = TimedJob(links, device)
    store = RehearsalStore(tp, {f"/{RUN_DIRS_VERDICT}": '{"run_id": "benchmark", "error": null}'})
    dist.init_process_group(backend_name(device), store=store, rank=0, world_size=tp, pg_options=timed)
    modes, times, skipped = args.modes.split(","), {}, {}
    try:
        with tempfile.TemporaryDirectory(prefix="domino-timed-") as logs:
            build = lambda mode: Runner(case_config(args, model, tp, sp, mode, logs), mode, device)  # noqa: E731
            if "megatron-core" in modes:
                skipped["megatron-core"] = megatron_core_missing(case_config(args, model, tp, sp, "sync", logs))
                modes = [m for m in modes if m not in skipped or not skipped[m]]
            if args.device == "cpu":  # every mode alive, in rotating rounds
                trainers = {mode: build(mode) for mode in modes}
                if args.comm_share:
                    links = LinkModel.parse(calibrated_link(trainers, timed, args), per_node)
                times = rotating_rounds(modes, args.steps, args.warmup,
                                        lambda mode: timed_step(trainers[mode], timed, links, mode))
                for trainer in trainers.values():
                    trainer.close()
            else:  # one slice at a time
                for mode in modes:
                    trainer = build(mode)
                    for _ in range(args.warmup):
                        timed_step(trainer, timed, links, mode)
                    times[mode] = [timed_step(trainer, timed, links, mode) for _ in range(args.steps)]
                    trainer.close()
                    del trainer
                    torch.cuda.empty_cache()
            tokens = MODELS[model][2] * MODELS[model][3]
    finally:
        if "megatron-core" in modes:
            from megatron.core import parallel_state
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return summarize(model, tp, sp, links.describe(), times, tokens) | {"skipped": {m: w for m, w in skipped.items()
                                                                                 if w}}


def megatron_core_missing(cfg) -> str | None:
    """Why megatron-core's row cannot run this case (None: it can)."""
    import importlib.util
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return "megatron-core is not installed"
    import megatron_core_gpt
    if cfg.parallel.sequence_parallel and cfg.parallel.tp > 1 and cfg.parallel.backend != "nccl":
        return "megatron-core's sequence parallelism allocates on torch.cuda.current_device()"
    return megatron_core_gpt.expressible(cfg, tp_allowed=True)


def summarize(model, tp, sp, link, times: dict, tokens: int) -> dict:
    """Per mode: the median step, tokens/s, speed-up over sync, and the share of sync's communication hidden, from
    step times and (``hidden_waits``) from the time this rank stood at waits, which compute noise cannot touch."""
    median = {mode: statistics.median(t for t, _, _ in v) for mode, v in times.items()}
    exposed = {mode: statistics.median(e for _, e, _ in v) for mode, v in times.items()}
    t_sync, t_free = median["sync"], median["nocomm"]
    rows = [{"mode": mode, "step_s": t, "tokens_per_s": tokens / t, "speedup": t_sync / t,
             "hidden": (t_sync - t) / (t_sync - t_free) if t_sync > t_free else float("nan"),
             "exposed_s": exposed[mode],
             "hidden_waits": 1 - exposed[mode] / exposed["sync"] if exposed["sync"] else 0.0}
            for mode, t in median.items()]
    return {"model": model, "tp": tp, "sp": sp, "link": link, "comm_share_sync": (t_sync - t_free) / t_sync,
            "modes": rows, "samples": times}


def main(argv=None) -> None:
    import torch
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = []
    for model in args.models.split(","):
        for tp in (int(t) for t in args.tp.split(",")):
            for sp in (s == "on" for s in args.sp.split(",")):
                case = run_case(args, model, tp, sp)
                cases.append(case)
                print(f"{model} tp {tp}{' sp' if sp else ''}, {case['link']}: sync spends "
                      f"{case['comm_share_sync']:.1%} of its step communicating", flush=True)
    rows = [[c["model"], c["tp"], "on" if c["sp"] else "off", f"{c['comm_share_sync']:.1%}", r["mode"],
             f"{r['step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.0f}", f"{r['speedup']:.3f}", f"{r['hidden']:.2f}",
             f"{r['exposed_s'] * 1e3:.1f}", f"{r['hidden_waits']:.2f}"] for c in cases for r in c["modes"]]
    print(format_table(["model", "tp", "sp", "comm", "mode", "step ms", "tokens/s", "speed-up", "hidden",
                        "exposed ms", "hidden (waits)"], rows))
    for c in cases:
        for mode, why in c.get("skipped", {}).items():
            print(f"{c['model']} tp {c['tp']}: {mode} skipped: {why}")
    print(f"results: {write_json(args.json, {'device': args.device, 'args': vars(args), 'cases': cases})}")


if __name__ == "__main__":
    main()
