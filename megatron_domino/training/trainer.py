"""The training loop: pipeline schedule with Domino inside, ZeRO step, LR schedule, metrics, checkpoints.

``training.run.run(cfg)`` builds it and runs it for the entry points. Every rank runs the same loop; only the last
stage's first rank writes metrics. A step's stretches of work are named by ``status.Status`` (hang reports, timers,
profiles); the log gets a ``StepRecord`` per step.
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist

from ..config.loader import save_config
from ..fp8.state import end_step as fp8_end_step
from ..fp8.weight_scales import fixed_for_the_step
from ..models.counters import flops_per_token
from ..models.expert_bias import update_expert_biases
from ..models.language_model import WORD_EMBEDDINGS
from ..models.logit_max import trackers as logit_trackers
from ..models.stage_chunks import build_chunks
from ..loss import Objective
from ..optim import LRSchedule
from ..optim.distributed_optimizer import DistributedOptimizer
from ..parallel import Topology, init_distributed
from ..parallel.attempt import current_attempt
from ..parallel.launch import collective_timeout_s
from ..parallel.random import RNGTracker
from ..parallel.state import ParallelState
from ..pipeline.engine import PipelineEngine
from ..pipeline.finalize_grads import finalize_grads
from ..pipeline.stages import chunk_places
from .cadence import StepCadence
from .checkpoint import Checkpointer, load_phase, resolve_load_path, save_phase
from .checkpoint_dir import RUN_DIRS_VERDICT, prepare_run_dirs
from .data_feed import DataFeed
from .guard import BadStepGuard
from .instruments import build_instruments
from .samples import TrainingSamples
from .signals import EarlySignals, PreemptionHandler
from .status import Status
from .moe_metrics import moe_metrics
from .metrics import device_peak_tflops
from .step_log import StepLog, StepRecord
from .watchdog import Watchdog


def param_dtype(train) -> torch.dtype:
    return torch.bfloat16 if train.bf16 else torch.float16 if train.fp16 else torch.float32


class Trainer:
    def __init__(self, cfg, writes_checkpoints: bool = True, print_rank_map: bool = True):
        """``writes_checkpoints`` False (evaluation) leaves checkpoint.dir alone: no lock, no checks.
        ``print_rank_map`` False skips gathering the host names for the start-up rank map (a rehearsal,
        whose fake process group moves no data, prints its own)."""
        self.cfg, par, timeout_s = cfg, cfg.parallel, collective_timeout_s(cfg.parallel)
        self.trains = writes_checkpoints
        self.device = init_distributed(par.backend, timeout_s)
        topology = Topology.from_config(par, dist.get_world_size())
        self.state = ParallelState(topology, self.device, timeout_s, strict=par.strict_transport)
        if print_rank_map:
            table = self.state.rank_map()
            if self.state.rank == 0:
                print(table, flush=True)
        # before any model or index is built: an unusable folder fails in seconds, not at the first save
        verdict_key = self.state.barriers.key(RUN_DIRS_VERDICT)
        self.launch_attempt = current_attempt()  # a restarted attempt of the job resumes from its own latest
        self.run_id, self.dir_lock, self.resumes = prepare_run_dirs(cfg, self.state.rank, verdict_key,
                                                                     writes_checkpoints, self.launch_attempt)
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
        self.chunks = build_chunks(cfg, self.state, chunk_places(cfg, self.state.pp_rank), dtype=self.dtype,
                                   device=self.device, init_seed=train.seed, rng=self.rng)
        self.optimizer = DistributedOptimizer.for_layout(self.chunks, cfg.optimizer, self.state, fp16=train.fp16,
                                                         bf16=train.bf16, bucket_alone=(WORD_EMBEDDINGS,))
        if cfg.optimizer.muon_qk_clip is not None:
            self.optimizer.clip_logits(logit_trackers(self.chunks))
        self.lr_schedule = LRSchedule.from_config(cfg.optimizer, train.steps)
        microbatches = train.num_microbatches(self.state.dp_size)
        self.objective = Objective(cfg, self.state, self.chunks, num_microbatches=microbatches, device=self.device)
        self.engine = PipelineEngine(self.chunks, self.state, cfg, device=self.device, dtype=self.dtype,
                                     num_microbatches=microbatches, loss=self.objective,
                                     on_backward=self.optimizer.begin_backward)
        # a step's weights stay as they are: FP8's copies and scales made once (ZeRO-3 releases gathered weights)
        self.weights_fixed = lambda: fixed_for_the_step(self.chunks, keep_copies=cfg.optimizer.zero_stage != 3)
        writer = self.engine.holds_loss and self.state.tp_rank == self.state.dp_rank == self.state.cp_rank == 0
        self.metrics, self.timers, self.profile, self.oom, self.stragglers = build_instruments(
            cfg, self.state, self.device, writer)
        self.step, self.status = 0, Status(self.timers)
        self.watchdog = Watchdog(self.state, par.timeout_s, self.describe)
        self.guard = (BadStepGuard(train.on_bad_step, train.spike_factor, train.spike_window, self.state.rank,
                                   self.state.topology.world_size, train.on_bad_step_after_rerun)
                      if train.on_bad_step else None)
        self.data = DataFeed(cfg, self.state, self.engine, self.watchdog)
        self.cadence = StepCadence(cfg, self.device, guarded=self.guard is not None)
        self.checkpointer = Checkpointer(cfg, self.state, self.rng, self.run_id)
        self.samples = (TrainingSamples(cfg, self.state, self.chunks, self.dtype, self.device)
                        if cfg.eval.sample_prompts and self.state.cp_size == 1 else None)  # CP: the config warns
        if self.state.rank == 0:
            save_config(cfg, os.path.join(cfg.log.dir, "config.yaml"))
        self._maybe_load()

    @property
    def phase(self) -> str:
        return self.status.phase

    def describe(self) -> str:
        """What this rank is doing now (the watchdog reports it if it stops changing)."""
        text = f"step {self.step + 1}: {self.phase}"
        return f"{text}, pipeline {self.engine.executor.describe()}" if self.phase == "forward-backward" else text

    # ----- checkpoints --------------------------------------------------------------------------
    def _maybe_load(self) -> None:
        """Load checkpoint.load; a restarted attempt of the job (torchrun, slurm requeue) loads its own ``latest``
        instead (``prepare_run_dirs`` decided it on rank 0)."""
        ckpt, attempt = self.cfg.checkpoint, self.launch_attempt
        path = resolve_load_path("auto" if self.resumes else ckpt.load, ckpt.dir)
        if attempt.number > 0 and not self.resumes:
            self._log_once(f"restart attempt {attempt.number} ({attempt.describe()}): no checkpoint of this job in "
                           f"checkpoint.dir, starting {f'from {path}' if path else 'from step 0'}")
        if path is None:
            return
        with self.watchdog.watching(load_phase(self.cfg, self.state.barriers)) as phase:
            metadata = self.checkpointer.load(path, chunks=self.chunks, optimizer=self.optimizer,
                                              lr_schedule=self.lr_schedule, phase=phase)
        if metadata.get("has_optimizer"):
            self.step = metadata["step"]
            self.data.resume(metadata["consumed_samples"])
            if self.trains:  # an evaluation leaves the training records alone
                self.metrics.resume_at(self.step)
        self._log_once(f"loaded checkpoint {path} (step {self.step})")
        if self.resumes:
            self._log_once(f"restart attempt {attempt.number}: resuming from step {self.step} ({attempt.describe()})")

    def save(self) -> None:
        ckpt = self.cfg.checkpoint
        if not ckpt.dir:
            return
        with self.status("saving a checkpoint"), self.watchdog.watching(save_phase(self.cfg, self.state.barriers)) \
                as phase:
            path = self.checkpointer.save(ckpt.dir, self.step, chunks=self.chunks, optimizer=self.optimizer,
                                          lr_schedule=self.lr_schedule, consumed_samples=self.data.consumed,
                                          keep=ckpt.keep, phase=phase)
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
        with self.status("data", timer="data", profile="data loading"):
            microbatches = self.data.next_train_step()
        lr = self.lr_schedule.lr_at(self.step)
        rerun = self.guard is not None and self.guard.action == "rerun"
        streams = self.rng.capture() if rerun else None  # the random streams the step starts from (dropout)
        loss, grad_norm = self._attempt(microbatches, lr)
        if rerun and self.guard.problem:  # refused: the same step again, to tell the machine from the data
            first = self.guard.problem
            self.rng.restore(streams)
            loss, grad_norm = self._attempt(microbatches, lr)
            self.guard.after_rerun(first, self.data.step_documents())
        if self.guard is not None and self.guard.problem and self.guard.verdict == "stop":
            return {"bad_step": self.guard.problem}  # the step is not counted: state stays at the last good one
        self.lr_schedule.step()
        self.step += 1
        self.data.count_step()
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "mtp_loss": self.objective.mtp_loss,
                "bad_step": self.guard.problem if self.guard is not None else None}

    def _attempt(self, microbatches: list[dict], lr: float) -> tuple:
        """Forward, backward and the update of this step (not applied if the guard refuses it): (loss, gradient
        norm)."""
        self.optimizer.zero_grad()
        with self.status("forward-backward", timer="forward-backward"), self.weights_fixed():
            if self.stragglers is not None:
                self.stragglers.start(self.step + 1)
            loss = self.engine.forward_backward(microbatches, self.optimizer.loss_scale)
            if self.stragglers is not None:
                self.stragglers.finish(self.step + 1)
            with self.status("gradient finalisation (data parallel, tied embeddings, sequence parallel)"):
                finalize_grads(self.chunks, self.state, self.optimizer)
        with self.status("optimizer step", timer="optimizer", profile="optimizer step"):
            stepped, grad_norm = self.optimizer.step(lr, self.guard.judge(self.step + 1, loss) if self.guard else None)
            if stepped:
                update_expert_biases(self.chunks, self.state.dp_cp_group)
            fp8_end_step(self.chunks, (self.state.tp_group, self.state.dp_cp_group), applied=stepped)
        return loss, grad_norm

    def evaluate(self) -> dict:
        if self.samples is not None:  # greedy continuations of eval.sample_prompts
            with self.status("evaluation: samples"):
                self.samples.write(self.step, self.metrics, self.optimizer)
        sets = ([None] if self.data.has_validation else []) + list(self.data.eval_sets)  # None: the data's split
        if not sets:
            self._log_once("no validation split (data.split gives it no share) and no eval.path: nothing to evaluate")
            return {}
        iters, records = self.cfg.train.eval_iters, []
        for name in sets:
            steps = self.data.validation_steps(iters, name)
            with self.status("evaluation"), self.weights_fixed():
                loss = (sum(self.engine.evaluate(batches) for batches in steps) / iters).item()
            record = {"step": self.step, "split": "valid", "loss": loss, "ppl": math.exp(min(loss, 50.0))}
            where = "validation" if name is None else f"validation on {name}"
            self.metrics.write(record if name is None else dict(record, set=name),
                               f"{where} at step {self.step} | loss {loss:.4f} | ppl {record['ppl']:.2f}")
            records.append(record)
        return records[0]

    def train(self, early: EarlySignals | None = None) -> None:
        """``early``: signals received while the run started (``signals.remember_early_warnings``), acted on at the
        first steps."""
        cfg, cadence = self.cfg, self.cadence
        preemption = PreemptionHandler(self.device, early)
        log, first_step = self._step_log(), self.step
        try:
            while not cadence.done(self.step):
                cadence.sync_debug(self.step - first_step >= 2 and not cadence.reads_host(self.step + 1))
                if self.profile is not None:
                    self.profile.before_step(self.step + 1)
                with self.oom.watching():
                    result = self.train_step()
                if self.profile is not None:
                    self.profile.after_step(self.step)
                if result["bad_step"]:
                    self._report_bad_step(result["bad_step"])
                with self.status("logging"):
                    log.after_step(self._step_record(result))
                if cadence.evaluates(self.step):
                    self.evaluate()
                with self.status("the preemption flag's all-reduce"):
                    stop = preemption.should_stop()
                if stop:  # decided one step after the signal, without a host sync
                    cadence.sync_debug(False)
                    self._log_once(f"preemption signal received: saving at step {self.step} and exiting")
                    self.save()
                    return
                if cadence.exits(self.step):
                    self.save()
                    return
                if cadence.saves(self.step):
                    self.save()
            cadence.sync_debug(False)
            if cfg.checkpoint.save_at_end:
                self.save()
        finally:
            cadence.sync_debug(False)
            if sys.exc_info()[0] is None:  # the run's last checkpoint is published before it ends
                self.checkpointer.wait()
            if self.profile is not None:
                self.profile.close()
            preemption.close(finish=sys.exc_info()[0] is None)

    def _step_log(self) -> StepLog:
        cfg, tokens = self.cfg, self.cadence.tokens_per_step
        return StepLog(logs=self.cadence.logs, steps=cfg.train.steps, first_step=self.step, tokens_per_step=tokens,
                       flops_per_step=flops_per_token(cfg.model, cfg.model.seq_length) * tokens,
                       world_size=self.state.topology.world_size, device=self.device,
                       peak=device_peak_tflops(self.device, cfg.log.peak_tflops), write=self.metrics.write,
                       window_extras=self._window_extras)

    def _step_record(self, result: dict) -> StepRecord:
        skipped = self.optimizer.skipped_steps + (self.guard.skipped if self.guard else 0)
        return StepRecord(self.step, result["loss"], result["lr"], result["grad_norm"], self.data.consumed, skipped,
                          result["mtp_loss"], self.optimizer.loss_scale if self.cfg.train.fp16 else None)

    def _window_extras(self) -> dict:
        """What a log window's record adds, read only then: packing imbalance, MoE balance, timers."""
        extras = self.data.balancer.take() if self.data.balancer is not None else {}
        if self.cfg.model.num_experts:
            extras.update(moe_metrics(self.chunks, self.cfg.model, self.device))
        if self.cfg.log.timers:
            self.timers.add("p2p-wait", self.engine.executor.p2p.take_wait_seconds())
            extras["timers_ms"] = self.timers.report()
        return extras

    def _report_bad_step(self, problem: str) -> None:
        """Every rank knows the bad step; the metrics rank records it (JSONL and console), and under
        train.on_bad_step=stop every rank saves the last good step and stops."""
        verdict = self.guard.verdict
        step = self.step + (verdict == "stop")  # a stopped step was not counted
        self.metrics.write({"step": step, "split": "bad_step", "problem": problem, "action": verdict},
                           f"{problem}: {verdict}")
        if verdict == "stop":
            self.save()
            self.checkpointer.wait()
            raise self.guard.stop_error(saved=bool(self.cfg.checkpoint.dir))

    def close(self) -> None:
        self.release_checkpoint_dir()
        self.watchdog.close()
        self.metrics.close()
        self.state.destroy()

