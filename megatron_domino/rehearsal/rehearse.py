"""Rehearse a full-size training job on one CPU process: each distinct rank role, two steps, on fake devices.

For a config at its real world size, every rank whose work differs (each pipeline stage, with all its
virtual stages; under CP the last ring member beside the first; under EP the last expert-parallel rank)
is played in turn, at its real rank, through the real trainer: mock data, the schedule, Domino, the loss,
backward, the DP reduction, the ZeRO step and the parameter all-gather. Torch's fake process group stands
in for NCCL (collectives are issued and counted, nothing moves), torch's ``FakeTensorMode`` for the
tensors (real shapes and dtypes, no storage), the fake CUDA library for the device guard and hooks, and
``runtime.RehearsalRuntime`` for the CUDA runtime calls the library makes. Step 1 warms up (lazy
optimizer state); step 2 is steady state, where the peak memory, the collectives and the host syncs are
measured. The fake CUDA library must be loaded before torch is imported: ``tools/rehearse.py`` does that.

Micro-batches: a step with m of them holds at most as many in flight as the schedule says, reached long
before m for large m. ``microbatches="auto"`` runs the fewest (at least 2, so gradients accumulate, and as many as
a V schedule needs to fill its V) that give every rank the same in-flight peak as the config's m, taken from the
schedule itself, and says so.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from ..config.loader import load_config
from ..optim.weight_store import ShardedWeights
from ..parallel import device
from ..parallel.topology import Topology
from ..pipeline.program import max_in_flight
from ..pipeline.schedules import build_schedule, get, least_microbatches, schedule_kind
from ..planner.hardware import get_gpu
from ..planner.memory import GIB, estimate_stages
from ..training.checkpoint_dir import RUN_DIRS_VERDICT
from . import fake_cuda
from .collectives import CollectiveCounter
from .dispatch import RehearsalMode
from .host_syncs import HostSyncDetector
from .kernels import CudaKernels, compiled_regions_eager, fp8_kernels_present
from .memory import CATEGORIES, AllocationAccounting
from .runtime import RehearsalRuntime
from .store import RehearsalStore

GPUS_PER_NODE = 8
GPU_NAMES = {"h100-80gb": ("NVIDIA H100 80GB HBM3", (9, 0)), "h200-141gb": ("NVIDIA H200", (9, 0)),
             "a100-80gb": ("NVIDIA A100-SXM4-80GB", (8, 0)), "a100-40gb": ("NVIDIA A100-SXM4-40GB", (8, 0))}
# what a rehearsal changes in any config: synthetic data, nothing written but the log folder, no logging step
FIXED = ["data.mock=true", "tokenizer.type=NullTokenizer", "tokenizer.model=null", "tokenizer.vocab_file=null",
         "tokenizer.merge_file=null", "checkpoint.dir=null", "checkpoint.load=null", "log.tensorboard=false",
         "log.wandb_project=null", "parallel.backend=nccl", "log.interval=1000000", "train.eval_interval=0",
         "parallel.strict_transport=false", "log.straggler_interval=0", "log.profile_steps=null",
         "parallel.timeout_s=86400"]  # a fake step of a large model may take minutes: not a hang
# what it changes unless told otherwise: mock documents of real corpora's length (each is a kernel call per layer
# under data.reset_attention_mask; mock data's own 32 tokens would make a 128K sequence 4,000 of them)
DEFAULTS = ["data.mock_document_tokens=2048"]


def role_ranks(topology: Topology, stages: str = "all") -> list[int]:
    """One rank per distinct role: each pipeline rank at tp = cp = dp = 0, and under CP / EP also the last ring
    member and the last expert-parallel rank of each stage. ``stages`` "outer": only the first two stages and
    the last, each at cp = dp = 0 (the middle stages differ from the second only in the micro-batches they hold
    in flight; the other ring members and expert ranks run the same shapes)."""
    if stages == "outer":
        return [topology.rank_of(pp=pp) for pp in sorted({0, min(1, topology.pp - 1), topology.pp - 1})]
    ranks = []
    for pp in range(topology.pp):
        ranks.append(topology.rank_of(pp=pp))
        if topology.cp > 1:
            ranks.append(topology.rank_of(pp=pp, cp=topology.cp - 1))
        if topology.ep > 1:
            ranks.append(topology.rank_of(pp=pp, dp=topology.ep - 1))
    return ranks


def fewest_microbatches(cfg, dp: int, pp_rank: int) -> int:
    """The fewest micro-batches (>= 2, so gradients accumulate) whose schedule gives pipeline rank ``pp_rank``
    the in-flight peak it has with the config's own count (a rank's program is rehearsed alone)."""
    par, m = cfg.parallel, cfg.train.num_microbatches(dp)
    kind = schedule_kind(par.pp, par.virtual_pp, par.pipeline_schedule)
    if kind == "none":
        return min(m, 2)

    def peak(count: int) -> int:
        return max_in_flight(build_schedule(kind, par.pp, count, par.virtual_pp)[pp_rank])
    target, step = peak(m), get(kind).microbatch_step(par.pp)
    least = max(2, least_microbatches(kind, par.pp))  # the V schedules need theirs to fill the V
    return next((count for count in range(step * -(-least // step), m, step) if peak(count) == target), m)


def role_config(path: str, overrides: list[str], job, dp: int, pp_rank: int, microbatches="auto", fixed=FIXED):
    """The job's config for one role: ``microbatches`` "auto" (``fewest_microbatches``), "full" or a number;
    ``fixed``: the settings every role gets whatever the config says (``FIXED``)."""
    full = job.train.num_microbatches(dp)
    count = (fewest_microbatches(job, dp, pp_rank) if microbatches == "auto" else
             full if microbatches == "full" else int(microbatches))
    if count == full:
        return job
    return load_config(path, [*DEFAULTS, *overrides, *fixed,
                              f"train.global_batch_size={count * job.train.micro_batch_size * dp}"])


def claim_state(memory: AllocationAccounting, trainer) -> None:
    """Weights, gradient buffers and optimizer state, by what owns them."""
    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    optimizer = trainer.optimizer
    grads = [t for buffer in optimizer.buffers
             for t in [buffer.grad_data, buffer.shard_data] + [bucket.grad for bucket in buffer.buckets]]
    states = optimizer.device_state()
    memory.claim(params + [buffer.weights.shard for buffer in optimizer.buffers if buffer.weights.sharded],
                 "parameters", force=True)
    memory.claim(grads, "gradients", force=True)
    masters = [m for m, f in zip(optimizer.masters, optimizer.fragments)
               if m is not f.data and m.device == f.data.device]  # not those offloaded to the host
    memory.claim(masters + states,
                 "optimizer", force=True)


@contextlib.contextmanager
def weights_resized(memory: AllocationAccounting):
    """ZeRO-3's gathers and releases resize storages in place, which no allocation shows: count them."""
    gather, release = ShardedWeights.gather, ShardedWeights.release

    def counted_gather(store, bucket, async_op):
        work = gather(store, bucket, async_op)
        memory.resized(store.full(bucket), "parameters")
        return work

    def counted_release(store, bucket):
        release(store, bucket)
        memory.resized(store.full(bucket), "parameters")

    ShardedWeights.gather, ShardedWeights.release = counted_gather, counted_release
    try:
        yield
    finally:
        ShardedWeights.gather, ShardedWeights.release = gather, release


def _step(trainer, preemption, memory) -> None:
    with torch.autograd.graph.saved_tensors_hooks(memory.saved_for_backward, lambda tensor: tensor):
        trainer.train_step()
    preemption.should_stop()


def rehearse_rank(cfg, world_size: int, rank: int, gpu: str = "h100-80gb", job=None) -> dict:
    """Two steps of ``rank`` (see the module docstring); returns its role record, with the planner's estimate
    for ``job`` (the config as the job runs it: ``cfg`` may hold fewer micro-batches)."""
    from ..training.signals import PreemptionHandler
    from ..training.trainer import Trainer
    library = fake_cuda.library()
    memory, syncs, collectives = AllocationAccounting(), HostSyncDetector(), CollectiveCounter()
    name, capability = GPU_NAMES[get_gpu(gpu).name]
    runtime = RehearsalRuntime(library, syncs, memory, name, capability)
    previous = device.install(runtime)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % GPUS_PER_NODE))
    store = RehearsalStore(world_size, {f"/{RUN_DIRS_VERDICT}": json.dumps({"run_id": "rehearsal", "error": None})})
    dist.init_process_group("fake", store=store, rank=rank, world_size=world_size)
    start = time.perf_counter()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), RehearsalMode(memory, syncs, collectives), CudaKernels(), \
                weights_resized(memory), fp8_kernels_present(GPUS_PER_NODE), compiled_regions_eager():
            trainer = Trainer(cfg, writes_checkpoints=False, print_rank_map=False)
            try:
                collectives.name_groups(trainer.state)
                preemption = PreemptionHandler(trainer.device)
                claim_state(memory, trainer)
                runtime.step = 1
                _step(trainer, preemption, memory)
                claim_state(memory, trainer)
                memory.reset_peak()
                runtime.step, syncs.steady, collectives.counting = 2, True, True
                _step(trainer, preemption, memory)
                syncs.steady, collectives.counting = False, False
                preemption.close(finish=False)
                coordinate = trainer.state.topology.coordinate(rank)
                instructions = sum(1 for _ in trainer.engine.program)
                pp_rank = trainer.state.pp_rank
            finally:
                trainer.close()
    finally:
        dist.destroy_process_group()
        device.install(previous)
    job = job or cfg
    plan = estimate_stages(job, Topology.from_config(job.parallel, world_size).dp, get_gpu(gpu))[pp_rank]
    return {"rank": rank,
            "coords": {"tp": coordinate.tp, "cp": coordinate.cp, "pp": coordinate.pp, "dp": coordinate.dp,
                       "ep": coordinate.dp % cfg.parallel.ep},
            "peak_memory_gib": memory.peak_bytes / GIB,
            "planner_memory_gib": (plan.total - plan.overhead) / GIB,
            "planner_overhead_gib": plan.overhead / GIB,
            "memory_by_category_gib": {c: memory.peak_by_category[c] / GIB for c in CATEGORIES},
            "device": "cuda", "microbatches": cfg.train.num_microbatches(Topology.from_config(
                cfg.parallel, world_size).dp), "instructions": instructions, "collectives": collectives.counts,
            "host_syncs": len(syncs.unexplained), "host_syncs_by_design": len(syncs.found) - len(syncs.unexplained),
            "host_sync_sites": [str(s) for s in syncs.found], "seconds": time.perf_counter() - start}


def rehearse(config: str, world_size: int, overrides: list[str] = (), microbatches="auto",
             gpu: str = "h100-80gb", ranks: list[int] | None = None, stages: str = "all") -> dict:
    """Every role of ``config`` at ``world_size`` ranks (or ``ranks``); the JSON object ``tools/rehearse.py``
    writes."""
    with tempfile.TemporaryDirectory(prefix="rehearsal-") as logs:
        overrides = [*overrides, f"log.dir={logs}"]
        job = load_config(config, [*DEFAULTS, *overrides, *FIXED])
        topology = Topology.from_config(job.parallel, world_size)
        roles = [rehearse_rank(role_config(config, overrides, job, topology.dp, topology.coordinate(rank).pp,
                                           microbatches), world_size, rank, gpu, job)
                 for rank in (ranks or role_ranks(topology, stages))]
    return {"config": config, "world_size": world_size, "gpu": gpu,
            "layout": {"tp": topology.tp, "cp": topology.cp, "pp": topology.pp, "dp": topology.dp,
                       "ep": topology.ep, "virtual_pp": topology.virtual_pp},
            "microbatches": job.train.num_microbatches(topology.dp), "roles": roles}
