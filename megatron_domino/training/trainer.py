"""The training loop: pipeline schedule with Domino inside, ZeRO step, LR schedule, metrics, checkpoints.

``run(cfg)`` is what the entry points call once the config is loaded and validated. Every
rank runs the same loop; only the last stage's first rank writes metrics.
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..config.errors import KnownError
from ..config.loader import config_to_dict, save_config
from ..data import MicroBatchLoader, build_train_valid_test_datasets
from ..models.counters import flops_per_token
from ..models.language_model import WORD_EMBEDDINGS
from ..models.ring_attention import split_for_context_parallel
from ..optim import LRSchedule
from ..optim.distributed_optimizer import DistributedOptimizer
from ..parallel import Topology, init_distributed
from ..parallel.state import ParallelState
from ..parallel.device import cuda
from ..parallel.launch import collective_timeout_s
from ..parallel.random import RNGTracker
from ..parallel.store_barrier import Phase
from ..pipeline.engine import PipelineEngine
from ..pipeline.finalize_grads import finalize_grads
from ..pipeline.stages import build_stage_chunks
from .checkpoint import Checkpointer, load_phase, resolve_load_path, save_phase
from .checkpoint_dir import RUN_DIRS_VERDICT, prepare_run_dirs
from .guard import BadStepGuard
from .metrics import MetricsWriter, Timers, device_peak_tflops, format_train_line, memory_gib
from .moe_metrics import moe_metrics
from .profiling import OomSnapshot, ProfileWindow
from .signals import PreemptionHandler
from .straggler import StragglerReport
from .watchdog import Watchdog


def param_dtype(train) -> torch.dtype:
    return torch.bfloat16 if train.bf16 else torch.float16 if train.fp16 else torch.float32


class Trainer:
    def __init__(self, cfg, writes_checkpoints: bool = True, print_rank_map: bool = True):
        """``writes_checkpoints`` False (evaluation) leaves checkpoint.dir alone: no lock, no checks.
        ``print_rank_map`` False skips gathering the host names for the start-up rank map (a rehearsal,
        whose fake process group moves no data, prints its own)."""
        self.cfg = cfg
        par = cfg.parallel
        self.device = init_distributed(par.backend, collective_timeout_s(par))
        topology = Topology.from_config(par, dist.get_world_size())
        self.state = ParallelState(topology, self.device, collective_timeout_s(par), strict=par.strict_transport)
        if print_rank_map:
            table = self.state.rank_map()
            if self.state.rank == 0:
                print(table, flush=True)
        # before any model or index is built: an unusable folder fails in seconds, not at the first save
        verdict_key = self.state.barriers.key(RUN_DIRS_VERDICT)
        self.run_id, self.dir_lock = prepare_run_dirs(cfg, self.state.rank, verdict_key, writes_checkpoints)
        try:
            self._build()
        except BaseException:
            self.release_checkpoint_dir()
            raise

    def _build(self) -> None:
        cfg = self.cfg
        par, train = cfg.parallel, cfg.train
        self.rng = RNGTracker.seeded(train.seed, self.state.tp_rank, self.state.pp_rank, self.device)
        self.dtype = param_dtype(train)
        self.chunks = build_stage_chunks(cfg, self.state, dtype=self.dtype, device=self.device, init_seed=train.seed,
                                         rng=self.rng)
        self.optimizer = DistributedOptimizer(self.chunks, cfg.optimizer, dp_group=self.state.dp_cp_group,
                                              tp_rank=self.state.tp_rank,
                                              norm_groups=[self.state.tp_group, self.state.pp_group],
                                              fp16=train.fp16, bf16=train.bf16, bucket_alone=(WORD_EMBEDDINGS,),
                                              expert_dp_group=self.state.expert_dp_group,
                                              ep_group=self.state.ep_group)
        self.lr_schedule = LRSchedule.from_config(cfg.optimizer, train.steps)
        self.num_microbatches = train.num_microbatches(self.state.dp_size)
        self.engine = PipelineEngine(self.chunks, self.state, cfg, device=self.device, dtype=self.dtype,
                                     num_microbatches=self.num_microbatches,
                                     on_backward=self.optimizer.set_last_microbatch)
        self.step, self.phase = 0, "start-up"
        self.watchdog = Watchdog(self.state, par.timeout_s, self.describe)
        writer = self.engine.holds_loss and self.state.tp_rank == 0 and self.state.dp_rank == 0
        wandb = (cfg.log.wandb_project, cfg.log.wandb_mode, config_to_dict(cfg)) if cfg.log.wandb_project else None
        self.metrics = MetricsWriter(cfg.log.dir, writer, cfg.log.tensorboard, wandb)
        self.timers = Timers(self.device, synchronize=cfg.log.timers)
        self.guard = (BadStepGuard(train.on_bad_step, train.spike_factor, train.spike_window, self.state.rank,
                                   self.state.topology.world_size) if train.on_bad_step else None)
        self.profile = (ProfileWindow(cfg.log.profile_steps, cfg.log.dir, self.state.rank, self.device,
                                      cfg.log.profile_memory, keep_history=cfg.log.oom_snapshot)
                        if cfg.log.profile_steps else None)
        self.oom = OomSnapshot(cfg.log.dir, self.state.rank, self.device, cfg.log.oom_snapshot)
        self.stragglers = (StragglerReport(self.state, cfg.log.straggler_interval, self.device, cfg.log.dir)
                           if cfg.log.straggler_interval else None)
        self._build_data()
        self.checkpointer = Checkpointer(cfg, self.state, self.rng, self.run_id)
        if self.state.rank == 0:
            save_config(cfg, os.path.join(cfg.log.dir, "config.yaml"))
        self._maybe_load()

    def describe(self) -> str:
        """What this rank is doing now (the watchdog reports it if it stops changing)."""
        text = f"step {self.step + 1}: {self.phase}"
        return f"{text}, pipeline {self.engine.executor.describe()}" if self.phase == "forward-backward" else text

    # ----- data ---------------------------------------------------------------------------------
    def _reads_data(self) -> bool:
        data = self.cfg.data
        return self.engine.needs_tokens or self.engine.holds_loss or data.reset_position_ids or data.reset_attention_mask

    def _build_data(self) -> None:
        train = self.cfg.train
        eval_samples = train.eval_iters * train.global_batch_size
        evaluations = (train.steps // train.eval_interval + 1) if train.eval_interval else 1
        phase = Phase("index build", self.cfg.data.index_build_timeout_s, "data.index_build_timeout_s",
                      self.state.barriers)
        with self.watchdog.watching(phase):
            train_ds, valid_ds, _ = build_train_valid_test_datasets(
                self.cfg, (train.steps * train.global_batch_size, evaluations * eval_samples, 0),
                build_on_this_rank=self.state.rank == 0, barrier=lambda: phase.barrier("indices cached"))
        reader = self._reads_data()
        make = lambda ds: (MicroBatchLoader(ds, train.global_batch_size, train.micro_batch_size,  # noqa: E731
                                            self.state.dp_rank, self.state.dp_size)
                           if ds is not None and reader else None)
        self.train_loader, self.valid_loader = make(train_ds), make(valid_ds)
        self.has_validation = valid_ds is not None
        self._consumed = 0

    def _next_microbatches(self, loader) -> list[dict]:
        if loader is None:  # a middle stage: activations come over p2p
            return [{} for _ in range(self.num_microbatches)]
        microbatches = loader.next_step()  # in host memory: the engine moves them to the device one at a time
        if self.state.cp_size > 1:  # this rank's two chunks of each sequence
            return [split_for_context_parallel(b, self.state.cp_size, self.state.cp_rank) for b in microbatches]
        return microbatches

    # ----- checkpoints --------------------------------------------------------------------------
    def _maybe_load(self) -> None:
        ckpt = self.cfg.checkpoint
        path = resolve_load_path(ckpt.load, ckpt.dir)
        if path is None:
            return
        with self.watchdog.watching(load_phase(self.cfg, self.state.barriers)) as phase:
            metadata = self.checkpointer.load(path, chunks=self.chunks, optimizer=self.optimizer,
                                              lr_schedule=self.lr_schedule, phase=phase)
        if metadata.get("has_optimizer"):
            self.step = metadata["step"]
            self._consumed = metadata["consumed_samples"]
            if self.train_loader is not None:
                self.train_loader.load_state_dict({"consumed_samples": self._consumed})
        self._log_once(f"loaded checkpoint {path} (step {self.step})")

    def save(self) -> None:
        ckpt = self.cfg.checkpoint
        if not ckpt.dir:
            return
        self.phase = "saving a checkpoint"
        with self.watchdog.watching(save_phase(self.cfg, self.state.barriers)) as phase:
            path = self.checkpointer.save(ckpt.dir, self.step, chunks=self.chunks, optimizer=self.optimizer,
                                          lr_schedule=self.lr_schedule, consumed_samples=self._consumed, keep=ckpt.keep,
                                          phase=phase)
        self._log_once(f"{'saving checkpoint (in the background)' if ckpt.async_save else 'saved checkpoint'} {path}")

    def release_checkpoint_dir(self) -> None:
        """Let another run use checkpoint.dir (rank 0 holds its lock)."""
        if self.dir_lock is not None:
            self.dir_lock.release()
            self.dir_lock = None

    def _log_once(self, message: str) -> None:
        if self.state.rank == 0:
            print(message, flush=True)

    # ----- the loop -----------------------------------------------------------------------------
    def train_step(self) -> dict:
        self.phase = "data"
        self.timers.start("data")
        with record_function("data loading"):
            microbatches = self._next_microbatches(self.train_loader)
        self.timers.stop("data")
        self.optimizer.zero_grad()
        self.phase = "forward-backward"
        self.timers.start("forward-backward")
        if self.stragglers is not None:
            self.stragglers.start(self.step + 1)
        loss = self.engine.forward_backward(microbatches, self.optimizer.loss_scale)
        if self.stragglers is not None:
            self.stragglers.finish(self.step + 1)
        self.phase = "gradient finalisation (data parallel, tied embeddings, sequence parallel)"
        finalize_grads(self.chunks, self.state, self.optimizer)
        self.timers.stop("forward-backward")
        self.phase = "optimizer step"
        self.timers.start("optimizer")
        lr = self.lr_schedule.lr_at(self.step)
        with record_function("optimizer step"):
            _, grad_norm = self.optimizer.step(lr, self.guard.judge(self.step + 1, loss) if self.guard else None)
        self.timers.stop("optimizer")
        if self.guard is not None and self.guard.problem and self.guard.action == "stop":
            return {"bad_step": self.guard.problem}  # the step is not counted: state stays at the last good one
        self.lr_schedule.step()
        self.step += 1
        self._consumed += self.cfg.train.global_batch_size
        self.phase = "logging"
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm,
                "bad_step": self.guard.problem if self.guard is not None else None}

    def evaluate(self) -> dict:
        if not self.has_validation:
            self._log_once("no validation split (data.split gives it no share): nothing to evaluate")
            return {}
        self.phase = "evaluation"
        total = 0.0
        iters = self.cfg.train.eval_iters
        if self.valid_loader is not None:
            self.valid_loader.load_state_dict({"consumed_samples": 0})
        for _ in range(iters):
            total += self.engine.evaluate(self._next_microbatches(self.valid_loader))
        loss = (total / iters).item()
        record = {"step": self.step, "split": "valid", "loss": loss, "ppl": math.exp(min(loss, 50.0))}
        self.metrics.write(record, f"validation at step {self.step} | loss {loss:.4f} | ppl {record['ppl']:.2f}")
        return record

    def _should_exit(self, tokens_seen: int) -> bool:
        train = self.cfg.train
        return self.step >= train.steps or (train.tokens is not None and tokens_seen >= train.tokens)

    def train(self) -> None:
        cfg, train = self.cfg, self.cfg.train
        preemption = PreemptionHandler(self.device)
        tokens_per_step = train.global_batch_size * cfg.model.seq_length
        flops_per_step = flops_per_token(cfg.model, cfg.model.seq_length) * tokens_per_step
        peak = device_peak_tflops(self.device, cfg.log.peak_tflops)
        start, window_start, window_steps = time.perf_counter(), time.perf_counter(), 0
        first_step = self.step
        try:
            while not self._should_exit(self.step * tokens_per_step):
                self._sync_debug(self.step - first_step >= 2 and not self._reads_host(self.step + 1, tokens_per_step))
                if self.profile is not None:
                    self.profile.before_step(self.step + 1)
                with self.oom.watching():
                    result = self.train_step()
                if self.profile is not None:
                    self.profile.after_step(self.step)
                if result["bad_step"]:
                    self._report_bad_step(result["bad_step"])
                window_steps += 1
                if self.step % cfg.log.interval == 0 or self.step == train.steps:
                    if self.device.type == "cuda":  # the window's time must include its queued GPU work
                        cuda.synchronize(self.device)
                    elapsed = time.perf_counter() - window_start
                    self._log_step(result, elapsed / window_steps, tokens_per_step, flops_per_step, peak,
                                   (time.perf_counter() - start) / (self.step - first_step))
                    window_start, window_steps = time.perf_counter(), 0
                if train.eval_interval and self.step % train.eval_interval == 0:
                    self.evaluate()
                interval = cfg.checkpoint.interval
                if preemption.should_stop():  # decided one step after the signal, without a host sync
                    self._sync_debug(False)
                    self._log_once(f"preemption signal received: saving at step {self.step} and exiting")
                    self.save()
                    return
                if train.exit_interval and self.step % train.exit_interval == 0:
                    self.save()
                    return
                if interval and self.step % interval == 0 and self.step < train.steps:
                    self.save()
            self._sync_debug(False)
            if cfg.checkpoint.save_at_end:
                self.save()
        finally:
            self._sync_debug(False)
            if sys.exc_info()[0] is None:  # the run's last checkpoint is published before it ends
                self.checkpointer.wait()
            if self.profile is not None:
                self.profile.close()
            preemption.close(finish=sys.exc_info()[0] is None)

    def _report_bad_step(self, problem: str) -> None:
        """Every rank knows the bad step; the metrics rank records it (JSONL and console), and under
        train.on_bad_step=stop every rank saves the last good step and stops."""
        step = self.step + (self.guard.action == "stop")  # a stopped step was not counted
        self.metrics.write({"step": step, "split": "bad_step", "problem": problem, "action": self.guard.action},
                           f"{problem}: {self.guard.action}")
        if self.guard.action == "stop":
            self.save()
            self.checkpointer.wait()
            raise self.guard.stop_error(saved=bool(self.cfg.checkpoint.dir))

    def _reads_host(self, step: int, tokens_per_step: int) -> bool:
        """Whether ``step`` logs, evaluates or saves: those read values on the host (sync) by design. So does
        every step under the bad-step guard (two scalars per step)."""
        cfg, train = self.cfg, self.cfg.train
        if self.guard is not None:
            return True
        periodic = (cfg.log.interval, train.eval_interval, cfg.checkpoint.interval, train.exit_interval,
                    cfg.log.straggler_interval)
        last = step >= train.steps or (train.tokens is not None and step * tokens_per_step >= train.tokens)
        return last or any(k and step % k == 0 for k in periodic)

    def _sync_debug(self, steady: bool) -> None:
        """log.sync_debug on CUDA: a host sync raises while ``steady`` (torch's sync debug mode), so a run
        proves its steady-state steps never wait for the GPU."""
        if self.cfg.log.sync_debug and self.device.type == "cuda":
            cuda.set_sync_debug_mode("error" if steady else "default")

    def _log_step(self, result, step_time, tokens_per_step, flops_per_step, peak, mean_step_time) -> None:
        world = self.state.topology.world_size
        in_use, peak_mem = memory_gib(self.device)
        tflops = flops_per_step / step_time / world / 1e12
        grad_norm = result["grad_norm"].item() if result["grad_norm"] is not None else None
        record = {"step": self.step, "loss": result["loss"].item(), "lr": result["lr"], "grad_norm": grad_norm,
                  "skipped_steps": self.optimizer.skipped_steps + (self.guard.skipped if self.guard else 0),
                  "tokens_per_s": tokens_per_step / step_time,
                  "tflops_per_device": tflops, "mfu": tflops / peak if peak else None, "mem_gib": in_use,
                  "mem_peak_gib": peak_mem, "step_time_s": step_time,
                  "eta_s": mean_step_time * (self.cfg.train.steps - self.step),
                  "consumed_samples": self._consumed}
        if self.cfg.train.fp16:
            record["loss_scale"] = self.optimizer.loss_scale
        if self.cfg.model.num_experts:
            record.update(moe_metrics(self.chunks, self.cfg.model, self.device))
        if self.cfg.log.timers:
            self.timers.add("p2p-wait", self.engine.executor.p2p.take_wait_seconds())
            record["timers_ms"] = self.timers.report()
        self.metrics.write({k: v for k, v in record.items() if v is not None},
                           format_train_line(record, self.cfg.train.steps))

    def report_failure(self, error: BaseException) -> None:
        """One line naming what this rank was doing and which peers went silent (a dead peer's coordinates),
        for errors that do not say where themselves (a known error's message does). Never raises: the
        state it describes may be what is broken (a step read from damaged checkpoint metadata)."""
        self.watchdog.close()
        if isinstance(error, (KnownError, KeyboardInterrupt)):
            return
        try:
            doing = f"{self.describe()}; {self.watchdog.describe_silent_peers(wait_s=5 * self.watchdog.interval_s)}"
        except Exception as problem:  # noqa: BLE001
            doing = f"a state that cannot be described ({type(problem).__name__}: {problem})"
        print(f"[{self.state.coordinates()}] failed while in: {doing}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.release_checkpoint_dir()
        self.watchdog.close()
        self.metrics.close()
        self.state.destroy()


def run(cfg, eval_only: bool = False) -> None:
    trainer = Trainer(cfg, writes_checkpoints=not eval_only)
    try:
        if eval_only:
            trainer.evaluate()
        else:
            trainer.train()
    except BaseException as error:
        trainer.report_failure(error)
        trainer.release_checkpoint_dir()
        raise
    if trainer.metrics.enabled:
        print(f"metrics: {trainer.metrics.jsonl_path}"
              + (f" | tensorboard: {os.path.join(cfg.log.dir, 'tensorboard')}" if cfg.log.tensorboard else ""),
              flush=True)
    trainer.close()
