"""Rank r of a cluster job on this one device, for real: its share of the model, real kernels, timed links.

For each role (as the fake rehearsal picks them, ``rehearse.role_ranks``), the real trainer builds rank r's
own share at full size (its stage, its TP/CP/EP slices, its ZeRO shard) on this device, with mock data, and
every collective goes through the timed process group (``timed_group.py``) at the job's real world size. Two
warm-up steps (lazy optimizer state, kernel choices), then ``steps`` timed steps, each closed by a device
synchronise. Per role: the median step, the modelled and the exposed communication per group (tp, cp, ep, dp,
pp, ...), the peak memory (the CUDA allocator's; on the CPU our storage accounting over step 2, which slows
that step only) beside the planner's, the planner's step estimate under the same links, and the job's step
predicted from the measured instructions (``instruction_times.predict_step``), with its MFU on CUDA.

A role that the planner says does not fit the device's free memory is refused before anything is allocated.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..config.errors import ConfigError, KnownError
from ..config.loader import load_config
from ..parallel.device import cuda
from ..parallel.topology import Topology
from ..planner.hardware import GPUS, get_gpu
from ..planner.memory import GIB, estimate_stages
from ..planner.timing import TimingAssumptions, estimate_step_time, model_flops_per_step
from ..pipeline.schedules import schedule_kind, v_shape
from .collectives import group_roles, peer_role, peers
from .instruction_times import InstructionTimes, predict_step
from .links import LinkModel
from .memory import CATEGORIES, AllocationAccounting
from .rehearse import DEFAULTS, FIXED, claim_state, role_config, role_ranks, weights_resized
from .shadows import tensors_in
from .store import RehearsalStore
from .timed_group import TimedJob, backend_name, register
from ..training.checkpoint_dir import RUN_DIRS_VERDICT

WARMUP_STEPS = 2


class RoleDoesNotFit(KnownError):
    """A role whose planned memory exceeds what the device has free: refused before it allocates."""


def fixed_settings(device: str) -> list[str]:
    """The fake rehearsal's fixed settings, with the backend of ``device`` (the timed group is the default group
    already; the backend setting only picks the device)."""
    return [s for s in FIXED if not s.startswith("parallel.backend=")] + [
        f"parallel.backend={'nccl' if device == 'cuda' else 'gloo'}"]


def planner_gpu(device: torch.device, name: str | None):
    """The catalogue GPU the planner models: ``name``, else this CUDA device's by its name, else "cpu"."""
    if name:
        return get_gpu(name)
    if device.type != "cuda":
        return get_gpu("cpu")
    found = cuda.get_device_name(device).upper()
    gib = cuda.mem_get_info(device)[1] / GIB
    matches = [g for key, g in GPUS.items() if key.split("-")[0].upper() in found]
    return min(matches, key=lambda g: abs(g.memory_gib - gib)) if matches else get_gpu("h100-80gb")


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return cuda.mem_get_info(device)[0]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_fits(job, dp: int, rank: int, pp_rank: int, gpu, device: torch.device) -> None:
    plan = estimate_stages(job, dp, gpu)[pp_rank]
    need, have = plan.total, free_bytes(device)
    if need > have:
        raise RoleDoesNotFit(
            f"rank {rank} (pipeline stage {pp_rank}) needs {need / GIB:.1f} GiB by the planner's estimate "
            f"({plan.overhead / GIB:.1f} GiB of it fixed overhead), but {device} has {have / GIB:.1f} GiB free. "
            f"Fix: rehearse it where it fits, or shrink its share (more parallel.tp or pp, model.recompute, a "
            f"higher optimizer.zero_stage, optimizer.offload)")


class _HostAllocations(TorchDispatchMode):
    """Counts the host storages every op makes (the CPU's peak memory: ``memory.AllocationAccounting``)."""

    def __init__(self, memory: AllocationAccounting):
        super().__init__()
        self.memory = memory

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.memory.track(tensors_in(out))
        return out


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        cuda.synchronize(device)


def _role_of(key, state) -> str:
    """An exposure key (a group name, or ("peer", rank)) -> the role it serves in ``state``."""
    if isinstance(key, tuple):
        return peer_role(key[1], *peers(state))
    return group_roles(state).get(key, key)


def _per_step(taken: list[dict], state) -> dict:
    """The mean per step of ``taken`` (one dict of seconds per step, by exposure key), by role."""
    total: dict = {}
    for values in taken:
        for key, value in values.items():
            role = _role_of(key, state)
            total[role] = total.get(role, 0.0) + value / len(taken)
    return total


def _counts(counts: dict, state) -> dict:
    total: dict = {}
    for key, (count, nbytes) in counts.items():
        entry = total.setdefault(_role_of(key, state), {"count": 0, "bytes": 0})
        entry["count"] += count
        entry["bytes"] += nbytes
    return total


def timed_rank(cfg, job, world_size: int, rank: int, device_type: str, links: LinkModel, steps: int,
               gpu_name: str | None = None) -> dict:
    """``steps`` timed steps of ``rank`` (see the module docstring); its role record."""
    from ..training.signals import PreemptionHandler
    from ..training.trainer import Trainer
    register()
    local = rank % links.gpus_per_node
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local))
    device = torch.device("cuda", local % cuda.device_count()) if device_type == "cuda" else torch.device("cpu")
    topology = Topology.from_config(job.parallel, world_size)
    pp_rank = topology.coordinate(rank).pp
    gpu = planner_gpu(device, gpu_name)
    check_fits(job, topology.dp, rank, pp_rank, gpu, device)
    timed = TimedJob(links, device)
    store = RehearsalStore(world_size, {f"/{RUN_DIRS_VERDICT}": '{"run_id": "rehearsal", "error": null}'})
    dist.init_process_group(backend_name(device), store=store, rank=rank, world_size=world_size, pg_options=timed)
    memory = AllocationAccounting(device_type="cpu")
    counting = contextlib.ExitStack()
    if device.type == "cpu":
        counting.enter_context(_HostAllocations(memory))
        counting.enter_context(weights_resized(memory))
    try:
        with counting:
            trainer = Trainer(cfg, writes_checkpoints=False, print_rank_map=False)
            preemption = PreemptionHandler(trainer.device)
            step = lambda: (trainer.train_step(), preemption.should_stop())  # noqa: E731 - the loop's per-step work
            claim_state(memory, trainer)
            times = InstructionTimes(device, pp_rank, cfg.parallel.pp, v_shape(schedule_kind(
                cfg.parallel.pp, cfg.parallel.virtual_pp, cfg.parallel.pipeline_schedule)))
            trainer.engine.executor.step_timer = times
            step()
            claim_state(memory, trainer)
            memory.reset_peak()
            if device.type == "cuda":
                cuda.reset_peak_memory_stats(device)
            with torch.autograd.graph.saved_tensors_hooks(memory.saved_for_backward, lambda tensor: tensor):
                step()
        step_seconds, outside, exposures = [], [], []
        try:
            for _ in range(WARMUP_STEPS - 1):
                step()
            _synchronize(device)
            timed.exposure.take()
            times.recording = True
            for _ in range(steps):
                begin = time.perf_counter()
                step()
                _synchronize(device)
                step_seconds.append(time.perf_counter() - begin)
                outside.append(step_seconds[-1] - times.take_program())
                exposures.append(timed.exposure.take())
            peak = cuda.max_memory_allocated(device) if device.type == "cuda" else memory.peak_bytes
            record = _record(cfg, job, trainer.state, topology, rank, gpu, links, step_seconds, outside, exposures,
                             times)
            record.update(peak_memory_gib=peak / GIB, device=str(device), kernel=getattr(
                getattr(timed.clock, "kernel", None), "kind", None), memory_by_category_gib=(
                {c: memory.peak_by_category[c] / GIB for c in CATEGORIES} if device.type == "cpu" else None))
            preemption.close(finish=True)
            return record
        finally:
            trainer.close()
    finally:
        dist.destroy_process_group()


def _record(cfg, job, state, topology, rank, gpu, links, step_seconds, outside, exposures, times) -> dict:
    par, coordinate = job.parallel, topology.coordinate(rank)
    linked = replace(gpu, intra_node_gbps=links.intra.gbps, inter_node_gbps=links.inter.gbps)
    assumptions = TimingAssumptions(nvlink_latency_us=links.intra.latency_us, ib_latency_us=links.inter.latency_us)
    plan = estimate_stages(job, topology.dp, gpu)[coordinate.pp]
    return {"rank": rank, "coords": {"tp": coordinate.tp, "cp": coordinate.cp, "pp": coordinate.pp,
                                     "dp": coordinate.dp, "ep": coordinate.dp % par.ep},
            "microbatches": cfg.train.num_microbatches(topology.dp),
            "step_s": statistics.median(step_seconds), "steps_s": step_seconds,
            "comm_s": _per_step([e[0] for e in exposures], state),
            "exposed_comm_s": _per_step([e[1] for e in exposures], state),
            "collectives": _counts(exposures[-1][2], state),
            "instruction_s": {f"{op}{stage}": s for (op, stage), s in sorted(times.medians().items())},
            "outside_program_s": statistics.median(outside),
            "planner_step_s": estimate_step_time(job, topology.dp, linked, links.gpus_per_node, assumptions).total,
            "planner_memory_gib": (plan.total - plan.overhead) / GIB, "planner_overhead_gib": plan.overhead / GIB,
            "gpu": gpu.name}


def job_step(job, dp: int, roles: list[dict]) -> float:
    """The job's step predicted from every role's instruction times (``instruction_times.predict_step``); the
    slowest role's time outside the pipeline program."""
    measured: dict = {}
    for role in roles:
        times = measured.setdefault(role["coords"]["pp"], {})
        for name, seconds in role["instruction_s"].items():
            times.setdefault((name[0], int(name[1:])), seconds)
    outside = max(role["outside_program_s"] for role in roles)
    return predict_step(job.parallel, job.train.num_microbatches(dp), measured, outside)


def rehearse_timed(config: str, world_size: int, overrides=(), device: str = "cpu", link: str = "dgx-h100",
                   gpus_per_node: int = 8, ranks=None, stages: str = "all", steps: int = 3,
                   microbatches="auto", gpu: str | None = None) -> dict:
    """Every role of ``config`` at ``world_size`` ranks (or ``ranks``), timed on ``device``: the JSON object
    ``tools/rehearse.py --device`` writes."""
    links = LinkModel.parse(link, gpus_per_node)
    fixed = fixed_settings(device)
    with tempfile.TemporaryDirectory(prefix="rehearsal-") as logs:
        overrides = [*overrides, f"log.dir={logs}"]
        job = load_config(config, [*DEFAULTS, *overrides, *fixed])
        topology = Topology.from_config(job.parallel, world_size)
        if job.parallel.variable_seq_lengths and job.parallel.pp > 1:
            raise ConfigError("parallel.variable_seq_lengths", True, "a timed rehearsal's receives get values, not the "
                              "shapes a peer sends", "rehearse with fixed sequence lengths (set it false)")
        roles = []
        for rank in ranks or role_ranks(topology, stages):
            cfg = role_config(config, overrides, job, topology.dp, topology.coordinate(rank).pp, microbatches, fixed)
            roles.append(timed_rank(cfg, job, world_size, rank, device, links, steps, gpu))
    predicted = job_step(job, topology.dp, roles)
    for role in roles:
        peak = get_gpu(role["gpu"]).peak_tflops * 1e12
        role["predicted_step_s"] = predicted
        role["mfu"] = (model_flops_per_step(job) / world_size / (predicted * peak)) if device == "cuda" else None
    return {"config": config, "world_size": world_size, "device": device, "link": links.describe(),
            "layout": {"tp": topology.tp, "cp": topology.cp, "pp": topology.pp, "dp": topology.dp,
                       "ep": topology.ep, "virtual_pp": topology.virtual_pp},
            "microbatches": job.train.num_microbatches(topology.dp), "predicted_step_s": predicted, "roles": roles}
