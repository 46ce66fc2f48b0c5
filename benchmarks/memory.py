"""Memory per rank by category, measured, beside the planner's estimate for the same config.

    python benchmarks/memory.py   # ZeRO 0-3 at dp = 2, 4, 8, offloaded ZeRO-1/2/3 at 4, recompute modes at dp = 1

Every configuration is its own job (4 ranks under torchrun, or one bare process), so each peak RSS
belongs to one configuration. Per rank, after a few training steps:
  params       bytes of this rank's weights held between steps (ZeRO-3: its shard, and the vectors kept whole)
  +gathered    ZeRO-3: the most bytes of gathered layers held at once (optimizer.prefetch_depth + 1 layers)
  grads        gradient buffers and shards held all step (optimizer.memory_report's grad_bytes after a step)
  +buckets     the gradient high-water mark above that (grad_peak_bytes): ZeRO-2's full buckets while they
               are written and reduced, at most 1 + IN_FLIGHT of optimizer.bucket_size_mb each
  optimizer    Adam's moments, plus the fp32 masters when weights are 16-bit (fp32 weights are their own)
  activations  the peak of what autograd saved for backward, per storage (views count once, weights not),
               seen through torch.autograd.graph.saved_tensors_hooks
  host         masters and Adam's moments offloaded to host memory (optimizer.offload=cpu), not in optim
  B/param      device model state (weights + gradients + optimizer) per weight, measured, beside the formula
               for bf16 weights, fp32 gradients and AdamW: 18 (ZeRO-0), 6 + 12/d (ZeRO-1), 2 + 16/d (ZeRO-2),
               18/d (ZeRO-3); offloaded: 6 (ZeRO-1), 2 + 4/d (ZeRO-2), 6/d (ZeRO-3)
  vs plan      measured model state at its peak (params + gathered + grads + buckets + optim) over the planner's
               (its params + grads + optim), minus 1
  peak RSS     the process's peak resident set, and its growth over the RSS before the Trainer was built
               (which adds transients, allocator slack and gloo buffers to the categories)
The planner's columns are megatron_domino.planner.memory.estimate_stages for the same config on its "cpu"
device (no fixed overhead).
"""
from __future__ import annotations

import argparse
import os
import resource

from common import (MODEL_FLAGS, add_model_args, run_harness,
                    RESULTS, build_trainer, format_table, forward_flags,
                    launch, load_benchmark_config, model_overrides, read_json, write_json)

MIB = 2**20
# (zero stage, recompute, ranks = dp, optimizer offloaded to the host)
ZERO_RUNS = [(stage, "none", dp, False) for dp in (2, 4, 8) for stage in (0, 1, 2, 3)]
OFFLOAD_RUNS = [(stage, "none", 4, True) for stage in (1, 2, 3)]
RECOMPUTE_RUNS = [(0, mode, 1, False) for mode in ("none", "full", "selective")]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=512, heads=8, layers=4, seq=256, micro_batch=4, bf16=True)
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step per DP rank")
    parser.add_argument("--steps", type=int, default=2, help="training steps before reading the sizes")
    parser.add_argument("--bucket-mb", type=float, default=1.0,
                        help="optimizer.bucket_size_mb: a model of GBs has buckets of tens of MB; this one of ~50 MB "
                             "gets 1 MB, the same ratio")
    parser.add_argument("--json", default=os.path.join(RESULTS, "memory.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--zero", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--offload", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--recompute", default="none", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


class SavedActivations:
    """Live bytes autograd keeps for backward, per storage, and their peak; parameters are not counted."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, list] = {}  # storage address -> [references, bytes]
        self.live = self.peak = 0

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or storage.nbytes() == 0:
            return tensor
        entry = self.refs.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _Held(tensor, self, key)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]


class _Held:
    """A saved tensor; autograd drops it after the backward that used it, which releases its bytes."""

    __slots__ = ("tensor", "owner", "key")

    def __init__(self, tensor, owner: SavedActivations, key: int):
        self.tensor, self.owner, self.key = tensor, owner, key

    def __del__(self):
        self.owner.release(self.key)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from megatron_domino.planner.hardware import get_gpu
    from megatron_domino.planner.memory import estimate_stages
    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    baseline = rss_bytes()
    overrides = model_overrides(args, f"memory/zero{args.zero}-{args.recompute}") + [
        "parallel.tp=1", "parallel.pp=1", "parallel.domino=false", f"optimizer.zero_stage={args.zero}",
        f"model.recompute={args.recompute}", f"optimizer.bucket_size_mb={args.bucket_mb}",
        f"optimizer.offload={'cpu' if args.offload else 'null'}",
        f"train.global_batch_size={args.micro_batch * world * args.microbatches}"]
    cfg = load_benchmark_config(overrides)
    trainer = build_trainer(cfg)
    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    saved = SavedActivations(params)
    optimizer = trainer.optimizer
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        for _ in range(args.steps):
            trainer.train_step()
    report = optimizer.memory_report()
    weights_are_masters = all(m is f.data for m, f in zip(optimizer.masters, optimizer.fragments))  # fp32 or bf16
    mine = {"rank": dist.get_rank(), "params_bytes": report["weight_bytes"], "weights": report["params"],
            "gathered_bytes": report["gathered_peak_bytes"],
            "grads_bytes": report["grad_bytes"], "grads_peak_bytes": report["grad_peak_bytes"],
            "optimizer_bytes": report["optimizer_state_bytes"] + (0 if weights_are_masters else report["master_bytes"])
            - report["host_bytes"], "host_bytes": report["host_bytes"],
            "activations_bytes": saved.peak,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "baseline_rss_bytes": baseline}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    trainer.close()
    if dist.get_rank() == 0:
        plan = estimate_stages(cfg, world, get_gpu("cpu"))[0]
        planner = {"params_bytes": plan.params, "grads_bytes": plan.grads, "optimizer_bytes": plan.optimizer,
                   "activations_bytes": plan.activations, "transient_bytes": plan.transient, "total_bytes": plan.total}
        planner["host_bytes"] = plan.host
        write_json(args.json, {"zero_stage": args.zero, "recompute": args.recompute, "dp": world,
                               "offload": args.offload,
                               "args": vars(args), "ranks": everyone, "planner": planner})


def formula_bytes_per_param(zero: int, dp: int, offload: bool = False) -> float:
    """On the device: bf16 weights, fp32 gradients, fp32 masters and Adam's two moments
    (optim/distributed_optimizer.py); with offload, masters and moments are in host memory."""
    if offload:
        return {1: 6.0, 2: 2 + 4 / dp, 3: 6 / dp}[zero]
    return {0: 18.0, 1: 6 + 12 / dp, 2: 2 + 16 / dp, 3: 18 / dp}[zero if dp > 1 else 0]


def report(runs: list[dict]) -> str:
    a = runs[0]["args"]
    mib = lambda value: f"{value / MIB:.1f}"  # noqa: E731
    rows = []
    for run in runs:
        p = run["planner"]
        for r in run["ranks"][:1] if a["bf16"] else run["ranks"]:
            state = r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"]
            per_param = state / r["weights"] if a["bf16"] else float("nan")
            peak = state + r["gathered_bytes"] + r["grads_peak_bytes"] - r["grads_bytes"]
            planned = p["params_bytes"] + p["grads_bytes"] + p["optimizer_bytes"]
            offload = run.get("offload", False)
            rows.append([f"zero {run['zero_stage']} dp {run['dp']} recompute {run['recompute']}"
                         + (" offload" if offload else ""), r["rank"],
                         mib(r["params_bytes"]), mib(r["gathered_bytes"]), mib(r["grads_bytes"]),
                         mib(r["grads_peak_bytes"] - r["grads_bytes"]), mib(r["optimizer_bytes"]),
                         mib(r.get("host_bytes", 0)),
                         f"{per_param:.2f} / {formula_bytes_per_param(run['zero_stage'], run['dp'], offload):.2f}",
                         f"{peak / planned - 1:+.1%}",
                         mib(r["activations_bytes"]), mib(r["peak_rss_bytes"]),
                         mib(r["peak_rss_bytes"] - r["baseline_rss_bytes"]),
                         mib(p["params_bytes"]), mib(p["grads_bytes"]), mib(p["optimizer_bytes"]),
                         mib(p.get("host_bytes", 0)), mib(p["activations_bytes"]), mib(p["total_bytes"])])
    headers = ["config", "rank", "params", "+gathered", "grads", "+buckets", "optim", "host", "B/param / formula",
               "vs plan", "act",
               "peak RSS", "RSS growth", "| plan params", "grads", "optim", "host", "act", "total"]
    return "\n".join([f"Memory per rank in MiB: GPT hidden {a['hidden']}, layers {a['layers']}, seq {a['seq']}, "
                      f"micro batch {a['micro_batch']} x {a['microbatches']} per step, buckets of {a['bucket_mb']} MB, "
                      f"{'bf16 weights, fp32 grads and masters' if a['bf16'] else 'fp32'}, AdamW; "
                      f"planner total = its categories + transient peaks", format_table(headers, rows)])


def drive(args) -> None:
    shared = forward_flags(args, MODEL_FLAGS + ("microbatches", "steps", "bucket_mb"))
    runs = []
    for zero, recompute, ranks, offload in ZERO_RUNS + OFFLOAD_RUNS + RECOMPUTE_RUNS:
        out = os.path.join(RESULTS, f"memory_zero{zero}_{recompute}_dp{ranks}{'_offload' if offload else ''}.json")
        launch(os.path.abspath(__file__), ranks, shared + ["--zero", str(zero), "--recompute", recompute,
                                                           "--json", out] + (["--offload"] if offload else []))
        runs.append(read_json(out))
    print(report(runs))
    print(f"results: {write_json(args.json, {'runs': runs})}")


if __name__ == "__main__":
    run_harness(parse_args(), worker, drive)
