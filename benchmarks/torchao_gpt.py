"""torchao's Float8Linear on the plain PyTorch GPT of our config's shape, compiled, as torchtitan runs FP8: the
side-by-side row of gpu_check.sh for FP8 "as torchao runs it".

    python benchmarks/torchao_gpt.py --config configs/gpt/1.3b.yaml [--recipe tensorwise|rowwise] [--warmup 5] [k=v ...]

- model: ``plain_pytorch_gpt.PlainGPT`` (the same math as ours at tp 1: learned positions, pre-LayerNorm, fused
  QKV, causal SDPA, GeLU MLP, tied output head) at the config's shape, fp32 weights under bf16 autocast; every
  linear of the blocks converted by torchao's ``convert_to_float8_training`` with the recipe's
  ``Float8LinearConfig`` (the output head over the tied embedding stays bf16, as ours does); each block under
  ``torch.compile`` (torchtitan's way: the blocks share one compiled graph);
- optimizer: torch AdamW (fused on CUDA), the config's learning rate and decay, gradient clipping as configured;
- data: random tokens (throughput does not depend on them); micro-batches accumulate to the global batch;
- timing: ``megatron_core_gpt.timed_run``: windows of log.interval steps closed by a device sync, medians after
  --warmup, tokens/s, TFLOP/s from our FLOP formula, MFU against log.peak_tflops.
Prints one JSON line, as megatron_core_gpt.py does. torchao must be importable: on the GPU machine, which has no
package registry, from a wheel carried there (benchmarks/README.md says how).
"""
from __future__ import annotations

import argparse
import json
import sys

import common  # noqa: F401 - puts the repository on sys.path
import torch
from megatron_core_gpt import checked_config, timed_run
from plain_pytorch_gpt import PlainGPT, make_optimizer


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="our YAML config (a GPT: learned positions, LayerNorm, GeLU)")
    parser.add_argument("--recipe", default="tensorwise", choices=("tensorwise", "rowwise"),
                        help="torchao's Float8LinearConfig.from_recipe_name (default tensorwise)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as pretrain_gpt.py takes them")
    return parser.parse_args(argv)


def build(cfg, recipe: str, device: torch.device):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    m = cfg.model
    model = PlainGPT(m.vocab_size, m.hidden_size, m.num_attention_heads, m.num_layers, m.seq_length).to(device)
    def fp8_shaped(module, name):  # what torchao's FP8 GEMM takes
        return all(n % 16 == 0 for n in module.weight.shape)
    convert_to_float8_training(model.layers, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=fp8_shaped)
    o = cfg.optimizer
    optimizer = make_optimizer(model, o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay)
    for index, block in enumerate(model.layers):
        model.layers[index] = torch.compile(block)
    return model, optimizer


def make_step(cfg, model, optimizer, device):
    train, vocab, seq = cfg.train, cfg.model.vocab_size, cfg.model.seq_length
    micro_batches = train.global_batch_size // train.micro_batch_size

    def step(index: int) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for _ in range(micro_batches):
            tokens = torch.randint(0, vocab, (train.micro_batch_size, seq + 1), device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], tokens[:, 1:]) / micro_batches
            loss.backward()
            total += loss.detach()
        if cfg.optimizer.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad, foreach=True)
        optimizer.step()
        return total
    return step


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = checked_config(args)
    import torchao
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, optimizer = build(cfg, args.recipe, device)
    result = timed_run(cfg, make_step(cfg, model, optimizer, device), device, args.warmup, "torchao")
    result.update(framework=f"torchao {torchao.__version__} Float8Linear ({args.recipe}, compiled)", device=str(device),
                  parameters=sum(p.numel() for p in model.parameters()))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
