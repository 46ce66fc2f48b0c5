"""megatron-core's GPTModel trained the way gpu_check.sh trains ours, for a side-by-side table.

    python benchmarks/megatron_core_gpt.py --config configs/gpt/1.3b.yaml [--warmup 5] [key=value ...]

It reads the same config file and overrides as pretrain_gpt.py, so the two runs cannot drift apart:
- model: ``megatron.core.models.gpt.GPTModel`` with ``get_gpt_layer_local_spec()`` (megatron-core's own modules:
  no Transformer Engine, no apex), learned absolute positions, GeLU, LayerNorm, tied embeddings, dropout as
  configured, the vocabulary padded as ours; its parameter count must equal ours (checked). bf16 through
  ``Float16Module``. Attention is megatron-core's local ``DotProductAttention`` (the s x s scores in memory),
  with its torch-only bias-GeLU and bias-dropout-add fusions on, as Megatron-LM enables them by default;
- optimizer: megatron-core's ``DistributedDataParallel`` (fp32 gradient buffer) and ``DistributedOptimizer``
  (fp32 master weights, torch AdamW inside, no decay on biases and norms), as our ZeRO-1 optimizer keeps bf16
  weights with fp32 masters; gradient clipping as configured; our LR schedule sets its learning rate each step;
- data: our ``MicroBatchLoader`` over our mock dataset: the very tokens our run trains on;
- world size 1: ``parallel_state.initialize_model_parallel(1, 1)``, NCCL;
- timing as our Trainer's: wall time of each window of log.interval steps, closed by torch.cuda.synchronize;
  the median over windows that end after --warmup steps; tokens/s = global batch tokens / step time;
  TFLOP/s from ``megatron_domino.models.counters.flops_per_token``; MFU against log.peak_tflops.
Prints one JSON line: tokens_per_s, tflops, mfu, peak_gib, loss (at the final step) and what ran.

Without a GPU (DRY=1 bash benchmarks/gpu_check.sh) megatron-core 0.16 cannot run unchanged, so three parts are
replaced, and the JSON's ``cpu_stand_ins`` says so:
- ``model_parallel_cuda_manual_seed`` needs CUDA RNG states; attention dropout always runs inside the RNG
  tracker's ``fork()``, so the no-op tracker (``initialize_rng_tracker(inference_rng_tracker=True)``) replaces it;
- ``DotProductAttention`` takes its score buffer from ``parallel_state.get_global_memory_buffer()``, allocated on
  ``torch.cuda.current_device()``; a CPU buffer replaces it;
- ``DistributedDataParallel`` puts its gradient buffers on ``torch.cuda.current_device()`` and the
  ``DistributedOptimizer`` makes tensors on ``device='cuda'``: plain torch AdamW over the model's (bf16)
  parameters replaces both, without fp32 masters.
The model is built on the CPU (``use_cpu_initialization``); forward, loss, backward, schedule, timing and output
run as on the GPU. The numbers then only show that the plumbing works.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import common  # noqa: F401 - puts the repository on sys.path
from megatron_domino.config import ConfigError, load_config
from megatron_domino.validation import validate_config
from megatron_domino.data import MicroBatchLoader, build_train_valid_test_datasets
from megatron_domino.models.counters import count_parameters, flops_per_token
from megatron_domino.optim import LRSchedule
from megatron_domino.parallel.launch import init_distributed
from megatron_domino.training.metrics import device_peak_tflops, memory_gib

CPU_STAND_INS = ["no-op RNG tracker (CUDA RNG states)", "CPU attention score buffer (global memory buffer)",
                 "torch AdamW over bf16 parameters (DistributedDataParallel + DistributedOptimizer)"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="our YAML config (a GPT: learned positions, LayerNorm, GeLU)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians (default 5)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as for pretrain_gpt.py")
    return parser.parse_intermixed_args(argv)


def expressible(cfg, tp_allowed: bool = False) -> str | None:
    """Why megatron-core's local GPT spec cannot run ``cfg`` as ours does (None: it can). It is compared only on
    the architecture both describe the same way; at tp = pp = 1 as a script, any tp under the timed group
    (benchmarks/domino_timed.py)."""
    m, wanted = cfg.model, {"position_embedding": "learned", "norm": "layernorm", "activation": "gelu",
                            "tie_embeddings": True, "bias": True, "recompute": "none"}
    wrong = {k: getattr(m, k) for k, v in wanted.items() if getattr(m, k) != v}
    layout_ok = cfg.parallel.pp == 1 and (tp_allowed or cfg.parallel.tp == 1)
    if wrong or m.query_groups != m.num_attention_heads or cfg.train.fp16 or not layout_ok:
        return f"megatron_core_gpt.py compares a GPT at tp = pp = 1 in bf16 or fp32 ({wanted}); got {wrong}"
    return None


def transformer_config(cfg, on_gpu: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig
    m, par = cfg.model, cfg.parallel
    return TransformerConfig(
        tensor_model_parallel_size=par.tp, sequence_parallel=par.sequence_parallel and par.tp > 1,
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_size, kv_channels=m.head_dim, attention_dropout=m.attention_dropout,
        hidden_dropout=m.hidden_dropout, normalization="LayerNorm", layernorm_epsilon=m.norm_eps,
        add_bias_linear=True, gated_linear_unit=False, activation_func=F.gelu, init_method_std=m.init_std,
        bf16=cfg.train.bf16, params_dtype=torch.bfloat16 if cfg.train.bf16 else torch.float32,
        bias_activation_fusion=True, bias_dropout_fusion=True, masked_softmax_fusion=False,
        use_cpu_initialization=not on_gpu)


class _CPUScoreBuffer:
    """CPU stand-in for megatron-core's global memory buffer (see the module docstring)."""

    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        return torch.empty(shape, dtype=dtype)


def build(cfg, device):
    """(model, optimizer, parameter count) of megatron-core's GPT on ``device``, this rank's share at cfg's tp (its
    process group started already: NCCL, or benchmarks/domino_timed.py's timed group)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    on_gpu = device.type == "cuda"
    parallel_state.initialize_model_parallel(cfg.parallel.tp, 1, create_gloo_process_groups=False)
    torch.manual_seed(cfg.train.seed)
    if on_gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        scores = _CPUScoreBuffer()
        parallel_state.get_global_memory_buffer = lambda: scores
    config = transformer_config(cfg, on_gpu)
    m = cfg.model
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=m.padded_vocab_size(cfg.parallel.tp),
                     max_sequence_length=m.max_positions, share_embeddings_and_output_weights=True,
                     position_embedding_type="learned_absolute")
    parameters = sum(p.numel() for p in model.parameters())
    if cfg.parallel.tp == 1 and parameters != count_parameters(m, tp=1, padded_vocab=True):
        sys.exit(f"megatron-core's GPT has {parameters:,} parameters, ours "
                 f"{count_parameters(m, tp=1, padded_vocab=True):,}: not the same model")
    if cfg.train.bf16:
        model = Float16Module(config, model)
    o = cfg.optimizer
    if on_gpu:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        model = DistributedDataParallel(config, ddp, model)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.beta1,
            adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.clip_grad, bf16=cfg.train.bf16,
            params_dtype=torch.bfloat16 if cfg.train.bf16 else torch.float32, use_distributed_optimizer=True),
            [model])
    else:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "wd_mult": 1.0}, {"params": rest, "wd_mult": 0.0}],
                                      lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    return model, optimizer, parameters


def make_step(cfg, model, optimizer, device):
    """One training step over a global batch: micro-batches with gradient accumulation, clipping, AdamW."""
    train = cfg.train
    dataset = build_train_valid_test_datasets(cfg, (train.steps * train.global_batch_size, 0, 0))[0]
    loader = MicroBatchLoader(dataset, train.global_batch_size, train.micro_batch_size, 0, 1)
    schedule = LRSchedule.from_config(cfg.optimizer, train.steps)
    s = cfg.model.seq_length
    positions = torch.arange(s, device=device).expand(train.micro_batch_size, s)
    causal = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)[None, None]  # True: masked (megatron's way)
    tokens_per_step = train.global_batch_size * s
    on_gpu = device.type == "cuda"

    def step(index: int) -> torch.Tensor:
        if on_gpu:
            model.zero_grad_buffer()
        optimizer.zero_grad()
        for group in optimizer.param_groups:  # as megatron's OptimizerParamScheduler would, on our schedule
            group["lr"] = schedule.lr_at(index)
            group["weight_decay"] = cfg.optimizer.weight_decay * group["wd_mult"]
        total = torch.zeros((), device=device)
        for batch in loader.next_step():
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            per_token = model(batch["tokens"], positions, causal, labels=batch["labels"])
            loss = (per_token.float() * batch["loss_mask"]).sum() / tokens_per_step
            loss.backward()
            total += loss.detach()
        if on_gpu:
            model.finish_grad_sync()
        elif cfg.optimizer.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad)
        optimizer.step()
        return total

    return step


def timed_run(cfg, step, device, warmup: int, name: str = "megatron-core") -> dict:
    """Our Trainer's timing: windows of log.interval steps closed by a device sync; medians after ``warmup``."""
    train, interval = cfg.train, cfg.log.interval
    windows, window_start, window_steps, loss = [], time.perf_counter(), 0, None
    for index in range(train.steps):
        result = step(index)
        window_steps += 1
        if (index + 1) % interval == 0 or index + 1 == train.steps:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            windows.append((index + 1, (time.perf_counter() - window_start) / window_steps))
            loss = result.item()
            print(f"{name} step {index + 1}/{train.steps} | loss {loss:.4f} | "
                  f"step {windows[-1][1]:.3f} s", file=sys.stderr, flush=True)
            window_start, window_steps = time.perf_counter(), 0
    steady = [t for end, t in windows if end > warmup]
    if not steady:
        sys.exit(f"no timing window ends after the {warmup} warm-up steps: raise train.steps")
    step_time = statistics.median(steady)
    tokens_per_s = train.global_batch_size * cfg.model.seq_length / step_time
    tflops = flops_per_token(cfg.model, cfg.model.seq_length) * tokens_per_s / 1e12
    peak = device_peak_tflops(device, cfg.log.peak_tflops)
    return {"tokens_per_s": tokens_per_s, "tflops": tflops, "mfu": tflops / peak if peak else None,
            "peak_gib": memory_gib(device)[1], "loss": loss, "step_time_s": step_time, "steps": train.steps,
            "timed_windows": len(steady)}


def checked_config(args):
    """``--config`` with its overrides, validated for one rank (a config error ends the run, saying it)."""
    try:
        cfg = load_config(args.config, args.overrides)
        validate_config(cfg, world_size=1, check_paths=not cfg.data.mock)
    except ConfigError as error:
        sys.exit(f"config error: {error}")
    return cfg


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = checked_config(args)
    if expressible(cfg):
        sys.exit(expressible(cfg))
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    import megatron.core
    device = init_distributed("nccl" if torch.cuda.is_available() else "gloo", cfg.parallel.timeout_s)
    model, optimizer, parameters = build(cfg, device)
    result = timed_run(cfg, make_step(cfg, model, optimizer, device), device, args.warmup)
    on_gpu = device.type == "cuda"
    result.update(framework=f"megatron-core {megatron.core.__version__}", device=str(device), parameters=parameters,
                  optimizer=("megatron-core DistributedOptimizer (fp32 masters, torch AdamW)" if on_gpu
                             else "torch AdamW over the model's parameters"),
                  cpu_stand_ins=[] if on_gpu else CPU_STAND_INS)
    print(json.dumps(result), flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
