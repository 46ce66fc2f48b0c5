"""The rules of the config's own sections (model, train, optimizer, files, operations; data: ``validate_data.py``).

The rules of the parts that live elsewhere sit next to them (the rank grid in ``parallel/topology.py``, the
pipeline split and schedule in ``pipeline/``, Domino in ``domino/plan.py``); ``megatron_domino.validation``
gathers them all. Nothing here touches torch.distributed.
"""
from __future__ import annotations

import os

from .checks import Checks
from .validate_attention import check_attention
from .validate_compile import check_compile
from .validate_fp8 import check_fp8
from .validate_mtp import check_mtp
from .validate_optimizer import check_muon, check_state_precision
from .validate_context_parallel import check_context_parallel
from .schema import (
    ACTIVATIONS,
    ATTENTION_BACKENDS,
    BACKENDS,
    BAD_STEP_ACTIONS,
    RERUN_VERDICT_ACTIONS,
    FREE_SPACE,
    LR_SCHEDULES,
    MAX_PREFETCH_DEPTH,
    NORMS,
    OFFLOAD_DEVICES,
    OPTIMIZERS,
    POSITION_EMBEDDINGS,
    RECOMPUTE,
    TOKENIZERS,
    WANDB_MODES,
    ZERO_STAGES,
    Config,
)

# Files a tokenizer type cannot work without.
TOKENIZER_FILES = {"GPT2BPETokenizer": ("vocab_file", "merge_file"), "SentencePieceTokenizer": ("model",),
                   "HuggingFaceTokenizer": ("model",), "NullTokenizer": ()}


def check_model(c: Checks, cfg: Config, device_type: str | None) -> None:
    m = cfg.model
    sizes_ok = all([c.positive("model.num_layers", m.num_layers), c.positive("model.hidden_size", m.hidden_size),
                    c.positive("model.num_attention_heads", m.num_attention_heads),
                    c.positive("model.ffn_hidden_size", m.ffn_hidden_size, optional=True),
                    c.positive("model.num_query_groups", m.num_query_groups, optional=True),
                    c.positive("model.kv_channels", m.kv_channels, optional=True)])
    c.positive("model.seq_length", m.seq_length)
    c.positive("model.max_position_embeddings", m.max_position_embeddings, optional=True)
    c.positive("model.vocab_size", m.vocab_size)
    c.positive("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by)
    c.one_of("model.position_embedding", m.position_embedding, POSITION_EMBEDDINGS)
    c.one_of("model.norm", m.norm, NORMS)
    c.one_of("model.activation", m.activation, ACTIVATIONS)
    c.one_of("model.recompute", m.recompute, RECOMPUTE)
    c.one_of("model.attention_backend", m.attention_backend, ATTENTION_BACKENDS)
    if m.attention_backend == "flash" and not (cfg.train.bf16 or cfg.train.fp16):
        if device_type == "cuda":
            c.fail("model.attention_backend", "flash", "CUDA's flash kernel takes bf16 or fp16 only, and these "
                   "weights are fp32: SDPA pinned to it raises 'No available kernel' at the first step",
                   "set train.bf16=true, or model.attention_backend=auto (or efficient, which takes fp32)")
        elif device_type is None:
            c.warnings.append("model.attention_backend=flash with fp32 weights runs on the CPU only: CUDA's flash "
                              "kernel takes bf16 or fp16 (set train.bf16=true)")
    c.positive("model.norm_eps", m.norm_eps)
    c.positive("model.init_std", m.init_std)
    c.in_range("model.attention_dropout", m.attention_dropout, 0.0, 1.0)
    c.in_range("model.hidden_dropout", m.hidden_dropout, 0.0, 1.0)
    check_attention(c, m)
    check_mtp(c, m)
    check_fp8(c, cfg)
    check_compile(c, m)
    if m.position_embedding == "learned" and m.seq_length > m.max_positions:
        c.fail("model.seq_length", m.seq_length,
               f"exceeds model.max_position_embeddings = {m.max_positions} (learned position table)",
               "raise model.max_position_embeddings or lower model.seq_length")
    if not sizes_ok:
        return
    if m.multi_latent_attention:
        return
    if m.num_attention_heads % m.query_groups:
        c.fail("model.num_query_groups", m.query_groups,
               f"must divide model.num_attention_heads = {m.num_attention_heads}",
               "choose a number of KV groups that divides the number of heads")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        c.fail("model.hidden_size", m.hidden_size, f"must be divisible by model.num_attention_heads = "
               f"{m.num_attention_heads} when model.kv_channels is unset",
               "change hidden_size or num_attention_heads, or set model.kv_channels")


def _check_timeouts(c: Checks, p) -> None:
    """The watchdog must report a hang (naming the silent peer) before NCCL aborts the collective."""
    if not all([c.positive("parallel.timeout_s", p.timeout_s),
                c.positive("parallel.collective_timeout_s", p.collective_timeout_s, optional=True)]):
        return
    if p.collective_timeout_s is not None and p.collective_timeout_s < 2 * p.timeout_s:
        c.fail("parallel.collective_timeout_s", p.collective_timeout_s,
               f"must be at least 2 * parallel.timeout_s = {2 * p.timeout_s:g}, so that the watchdog reports a hang "
               f"before the collective aborts",
               f"set parallel.collective_timeout_s >= {2 * p.timeout_s:g}, or null (2 * parallel.timeout_s)")


def f_and_b_turns(p) -> bool:
    """Whether DualPipeV's F&B units, with ``parallel.overlap_f_and_b``, have waits to take turns at (``p``:
    ``cfg.parallel``): Domino's at tp > 1, or the experts' exchanges at ep > 1."""
    return p.overlap_f_and_b and ((p.domino and p.tp > 1) or p.ep > 1)


def check_parallel(c: Checks, cfg: Config) -> None:
    """What the layout asks of the model: sequence parallelism splits the sequence; the ring's limits; the
    watchdog's timeouts; the backend. (What TP splits, the layers that split it check: ``models.attention``
    and ``models.mlp``.)"""
    p, m = cfg.parallel, cfg.model
    _check_timeouts(c, p)
    c.one_of("parallel.backend", p.backend, BACKENDS)
    if p.sequence_parallel and p.tp == 1:
        c.warnings.append("parallel.sequence_parallel=true has no effect with parallel.tp=1")
    if not all(isinstance(size, int) and size >= 1 for size in (p.tp, p.cp)):
        return  # the rank grid's rules (check_topology) name them
    if p.cp_a2a_output_overlap and p.cp == 1:
        c.warnings.append("parallel.cp_a2a_output_overlap=true has no effect with parallel.cp=1 (no all-to-alls)")
    if p.cp > 1:
        check_context_parallel(c, cfg)
    if p.sequence_parallel and m.seq_length >= 1:
        check_sequence_split(c, m.seq_length, p.tp, p.cp)


def check_sequence_split(c: Checks, seq_length: int, tp: int, cp: int) -> None:
    """Sequence parallelism shards each CP rank's s / cp tokens over tp (the planner's search calls this too)."""
    c.divides("model.seq_length", seq_length, tp * cp,
              "parallel.tp * parallel.cp (sequence parallel shards each rank's part of the sequence over tp)",
              "make the sequence length a multiple of tp * cp or turn parallel.sequence_parallel off")


def check_train(c: Checks, cfg: Config, dp: int | None) -> int | None:
    """Steps, batches, precision. Returns the micro-batches per step and DP rank when they are known."""
    t = cfg.train
    c.positive("train.steps", t.steps)
    c.positive("train.tokens", t.tokens, optional=True)
    batch_ok = all([c.positive("train.micro_batch_size", t.micro_batch_size),
                    c.positive("train.global_batch_size", t.global_batch_size)])
    c.at_least("train.seed", t.seed, 0)
    c.at_least("train.eval_interval", t.eval_interval, 0)
    c.at_least("train.exit_interval", t.exit_interval, 0)
    if t.eval_interval > 0:
        c.positive("train.eval_iters", t.eval_iters)
    if t.fp16 and t.bf16:
        c.fail("train.fp16", t.fp16, "and train.bf16 are both true",
               "keep one: train.bf16=true (preferred) or train.fp16=true")
    if not batch_ok:
        return None
    micro_batches = check_batch(c, t.global_batch_size, t.micro_batch_size, dp or 1)
    return micro_batches if dp is not None else None


def check_batch(c: Checks, global_batch: int, micro_batch: int, dp: int) -> int | None:
    """Each step is whole micro batches on every DP rank; returns their number per rank (None: it is not whole).
    The planner's search calls this for each micro batch it tries."""
    per_step = micro_batch * dp
    if global_batch % per_step:
        c.fail("train.global_batch_size", global_batch,
               f"must be a multiple of micro_batch_size * dp = {micro_batch} * {dp} = {per_step}",
               f"use a multiple of {per_step}, e.g. {per_step * max(1, global_batch // per_step)}")
        return None
    return global_batch // per_step


def check_optimizer(c: Checks, cfg: Config) -> None:
    o = cfg.optimizer
    c.one_of("optimizer.name", o.name, OPTIMIZERS)
    c.one_of("optimizer.lr_schedule", o.lr_schedule, LR_SCHEDULES)
    c.one_of("optimizer.zero_stage", o.zero_stage, ZERO_STAGES)
    c.positive("optimizer.lr", o.lr)
    c.at_least("optimizer.min_lr", o.min_lr, 0.0)
    if o.min_lr > o.lr > 0:
        c.fail("optimizer.min_lr", o.min_lr, f"exceeds optimizer.lr = {o.lr}", "set min_lr <= lr (e.g. lr / 10)")
    c.at_least("optimizer.weight_decay", o.weight_decay, 0.0)
    c.in_range("optimizer.beta1", o.beta1, 0.0, 1.0)
    c.in_range("optimizer.beta2", o.beta2, 0.0, 1.0)
    c.in_range("optimizer.momentum", o.momentum, 0.0, 1.0)
    c.positive("optimizer.eps", o.eps)
    c.at_least("optimizer.clip_grad", o.clip_grad, 0.0)
    c.positive("optimizer.bucket_size_mb", o.bucket_size_mb)
    _check_offload(c, o)
    _check_zero3(c, o)
    check_muon(c, cfg)
    check_state_precision(c, cfg)
    c.at_least("optimizer.warmup_steps", o.warmup_steps, 0)
    if o.decay_steps is not None:
        c.at_least("optimizer.decay_steps", o.decay_steps, 0)
    elif o.warmup_steps > cfg.train.steps:
        c.fail("optimizer.warmup_steps", o.warmup_steps, f"exceeds train.steps = {cfg.train.steps}, leaving no decay "
               "horizon (optimizer.decay_steps is unset)", "lower warmup_steps, raise train.steps or set decay_steps")
    c.in_range("optimizer.wsd_decay_fraction", o.wsd_decay_fraction, 0.0, 1.0, high_open=False)
    c.positive("optimizer.initial_loss_scale", o.initial_loss_scale)
    c.positive("optimizer.loss_scale_window", o.loss_scale_window)
    c.positive("optimizer.hysteresis", o.hysteresis)
    if not 0 < o.loss_scale_backoff < 1:
        c.fail("optimizer.loss_scale_backoff", o.loss_scale_backoff, "must lie in (0, 1)", "use 0.5")
    if c.positive("optimizer.min_loss_scale", o.min_loss_scale) and o.min_loss_scale > o.initial_loss_scale:
        c.fail("optimizer.min_loss_scale", o.min_loss_scale, f"exceeds optimizer.initial_loss_scale = "
               f"{o.initial_loss_scale}", "lower min_loss_scale (1.0 is usual)")


def _check_offload(c: Checks, o) -> None:
    """CPU offload moves the ZeRO shard's masters and moments (optim/offload.py), so it needs a shard."""
    if o.offload is None:
        return
    c.one_of("optimizer.offload", o.offload, OFFLOAD_DEVICES)
    if not 0 < o.offload_fraction <= 1:
        c.fail("optimizer.offload_fraction", o.offload_fraction, "must lie in (0, 1]",
               "use 1.0 to offload the whole shard, or e.g. 0.5 for half of it")
    if o.zero_stage == 0:
        c.fail("optimizer.offload", o.offload, "offloads the ZeRO shard of the optimizer state, and "
               "optimizer.zero_stage = 0 keeps none", "set optimizer.zero_stage=1 (2 or 3) with optimizer.offload=cpu")


def _check_zero3(c: Checks, o) -> None:
    """ZeRO-3's prefetch window is small: each prefetched layer holds its whole weights."""
    if not isinstance(o.prefetch_depth, int) or not 0 <= o.prefetch_depth <= MAX_PREFETCH_DEPTH:
        c.fail("optimizer.prefetch_depth", o.prefetch_depth, f"must be an integer in [0, {MAX_PREFETCH_DEPTH}]: "
               "each prefetched layer keeps its whole weights on the device", "use 1 (the next layer's gather in "
               "flight while one computes) or 0 (gather on use)")


def check_files(c: Checks, cfg: Config, check_paths: bool) -> None:
    tok, ck, log = cfg.tokenizer, cfg.checkpoint, cfg.log
    c.one_of("tokenizer.type", tok.type, TOKENIZERS)
    for name in TOKENIZER_FILES.get(tok.type, ()):
        if getattr(tok, name) is None:
            c.fail(f"tokenizer.{name}", None, f"is required by tokenizer.type={tok.type}", f"set tokenizer.{name}=PATH")
    for name in ("vocab_file", "merge_file", "model"):
        path = getattr(tok, name)
        if check_paths and path is not None and not os.path.exists(path):
            c.fail(f"tokenizer.{name}", path, "not found", "correct the path (relative to the working directory)")
    if ck.load == "auto" and ck.dir is None:
        c.fail("checkpoint.load", ck.load, "'auto' resumes from the latest checkpoint in checkpoint.dir, "
               "which is unset",
               "set checkpoint.dir=PATH")
    elif check_paths and ck.load not in (None, "auto") and not os.path.isdir(ck.load):
        c.fail("checkpoint.load", ck.load, "not found", "give an existing checkpoint directory, 'auto', or null")
    c.at_least("checkpoint.interval", ck.interval, 0)
    c.at_least("checkpoint.keep", ck.keep, 0)
    c.positive("checkpoint.save_timeout_s", ck.save_timeout_s)
    c.positive("checkpoint.load_timeout_s", ck.load_timeout_s)
    c.one_of("checkpoint.free_space", ck.free_space, FREE_SPACE)
    if ck.interval > 0 and ck.dir is None:
        c.fail("checkpoint.interval", ck.interval, "saving every N steps needs checkpoint.dir",
               "set checkpoint.dir=PATH")
    c.positive("log.interval", log.interval)
    c.positive("log.peak_tflops", log.peak_tflops, optional=True)
    if not log.dir:
        c.fail("log.dir", log.dir, "must name a directory", "set log.dir=runs/NAME")


def check_operations(c: Checks, cfg: Config) -> None:
    """The long-run tools: bad-step guard, wandb, straggler report, profiler window."""
    t, log = cfg.train, cfg.log
    if t.on_bad_step is not None:
        c.one_of("train.on_bad_step", t.on_bad_step, BAD_STEP_ACTIONS)
        c.one_of("train.on_bad_step_after_rerun", t.on_bad_step_after_rerun, RERUN_VERDICT_ACTIONS)
    if t.spike_factor is not None:
        if not t.spike_factor > 1:
            c.fail("train.spike_factor", t.spike_factor, "must be above 1 (a loss this many times the running "
                   "median is a spike)", "use e.g. train.spike_factor=3, or null to turn the spike check off")
        elif t.on_bad_step is None:
            c.fail("train.spike_factor", t.spike_factor, "needs train.on_bad_step to say what a spike does",
                   "set train.on_bad_step=skip or train.on_bad_step=stop")
    c.positive("train.spike_window", t.spike_window)
    if log.sync_debug and t.fp16:
        c.fail("log.sync_debug", True, "fp16's loss scaler reads its overflow flag on the host in every step (to "
               "skip an overflowed one), a host sync that sync_debug makes an error at step 3",
               "use train.bf16=true (no loss scaling), or set log.sync_debug=false for fp16 runs")
    if log.sync_debug and cfg.parallel.variable_seq_lengths and cfg.parallel.pp > 1:
        c.fail("log.sync_debug", True, "with parallel.variable_seq_lengths every pipeline receive reads its "
               "tensor's shape on the host, a host sync that sync_debug makes an error",
               "set parallel.variable_seq_lengths=false (every micro-batch at model.seq_length), or "
               "log.sync_debug=false")
    c.one_of("log.wandb_mode", log.wandb_mode, WANDB_MODES)
    c.at_least("log.straggler_interval", log.straggler_interval, 0)
    window = log.profile_steps
    if window is not None and not (isinstance(window, list) and len(window) == 2
                                   and all(isinstance(s, int) for s in window) and 1 <= window[0] <= window[1]):
        c.fail("log.profile_steps", window, "must be [start, end], whole steps with 1 <= start <= end",
               "e.g. log.profile_steps=[10,12], or null for no trace")
