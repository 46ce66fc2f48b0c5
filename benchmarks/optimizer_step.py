"""The optimizer step at Llama-3 8B's shapes on one CPU process: AdamW against Muon, Newton-Schulz apart.

    python benchmarks/optimizer_step.py [--layers 1] [--rounds 3] [--threads 2]

The model is Llama-3 8B's block (hidden 4096, 32 heads in 8 KV groups, SwiGLU of 14336) ``--layers`` times with a
1024-token vocabulary, fp32 weights, ZeRO-0 on one process (218M weights per block). Each round sets random
gradients and times, side by side:
  adamw          DistributedOptimizer.step with torch's multi-tensor AdamW (fp32 state)
  adamw bf16     the same with bf16 moments (optimizer.moments_dtype=bf16; LowPrecisionAdamW)
  muon - NS      Muon's step with Newton-Schulz replaced by a cast (momentum, exchange packing, the AdamW part,
                 the update of the masters): what Muon adds besides its matrix products
Newton-Schulz is timed once per distinct matrix shape (bf16, 5 steps, torch.optim.Muon's quintic) and summed over
the block's matrices (Q, K, V split), with its FLOPs; at dp d its owners share it (planner/muon.py: 1.00-1.06x the
mean at dp 8), so a rank runs about 1/d of it. Prints a table and writes benchmarks/results/optimizer_step.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from common import REPO, RESULTS, format_table, write_json


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=os.path.join(RESULTS, "optimizer_step.json"))
    return parser.parse_args(argv)


def _model(layers: int):
    from megatron_domino.config.loader import load_config
    from megatron_domino.models import LanguageModel
    cfg = load_config(os.path.join(REPO, "configs", "llama", "llama3-8b.yaml"),
                      [f"model.num_layers={layers}", "model.vocab_size=1024", "model.make_vocab_size_divisible_by=128"])
    return LanguageModel(cfg.model), cfg.model


class _Variant:
    """One optimizer over its own copy of the model (each keeps its buffers and state across rounds)."""

    def __init__(self, layers: int, opt, ns_free: bool):
        from megatron_domino.optim.distributed_optimizer import DistributedOptimizer
        self.opt, self.ns_free = opt, ns_free
        model, _ = _model(layers)
        self.dopt = DistributedOptimizer([model], opt, dp_group=None, tp_rank=0, norm_groups=[])
        self.step()  # the first step builds the state

    def step(self) -> float:
        from megatron_domino.optim import muon
        original = muon.newton_schulz
        if self.ns_free:
            muon.newton_schulz = lambda matrix, steps, coefficients, dtype: matrix.to(dtype)
        try:
            for buffer in self.dopt.buffers:
                buffer.grad_data.normal_(0, 1e-3)
            start = time.perf_counter()
            self.dopt.step(self.opt.lr)
            return time.perf_counter() - start
        finally:
            muon.newton_schulz = original


def _newton_schulz(model_cfg) -> tuple[float, float, list]:
    """(seconds, FLOPs) of Newton-Schulz over one block's matrices, each distinct shape timed once."""
    import torch
    from megatron_domino.optim.muon_math import newton_schulz, ns_flops
    h, d, g, heads, ffn = (model_cfg.hidden_size, model_cfg.head_dim, model_cfg.query_groups,
                           model_cfg.num_attention_heads, model_cfg.ffn_size)
    shapes = [(heads * d, h), (g * d, h), (g * d, h), (h, heads * d), (ffn, h), (ffn, h), (h, ffn)]
    timed, rows = {}, []
    for shape in sorted(set(shapes)):
        matrix = torch.randn(shape)
        start = time.perf_counter()
        newton_schulz(matrix, 5, (3.4445, -4.775, 2.0315), torch.bfloat16)
        timed[shape] = time.perf_counter() - start
        rows.append([f"{shape[0]} x {shape[1]}", shapes.count(shape), f"{timed[shape]:.2f}",
                     f"{ns_flops(*shape, 5) / timed[shape] / 1e9:.0f}"])
    return sum(timed[s] for s in shapes), float(sum(ns_flops(*s, 5) for s in shapes)), rows


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from megatron_domino.config.schema import OptimizerConfig
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, model_cfg = _model(args.layers)
    weights = sum(p.numel() for p in model.parameters())
    del model
    variants = {"adamw": (OptimizerConfig(name="adamw", bucket_size_mb=256.0, zero_stage=0), False),
                "adamw bf16 moments": (OptimizerConfig(name="adamw", moments_dtype="bf16", bucket_size_mb=256.0,
                                                       zero_stage=0), False),
                "muon - NS": (OptimizerConfig(name="muon", lr=0.02, bucket_size_mb=256.0, zero_stage=0), True)}
    built = {name: _Variant(args.layers, opt, ns_free) for name, (opt, ns_free) in variants.items()}
    times = {name: [] for name in variants}
    for _ in range(args.rounds):  # interleaved: the machine's drift hits every variant alike
        for name, variant in built.items():
            times[name].append(variant.step())
    medians = {name: statistics.median(t) for name, t in times.items()}
    ns_seconds, ns_flops_total, ns_rows = _newton_schulz(model_cfg)
    ns_seconds, ns_flops_total = ns_seconds * args.layers, ns_flops_total * args.layers
    base = medians["adamw"]
    rows = [[name, f"{seconds:.3f}", f"{seconds / base:.2f}"] for name, seconds in medians.items()]
    rows.append(["muon (one rank, NS whole)", f"{medians['muon - NS'] + ns_seconds:.1f}",
                 f"{(medians['muon - NS'] + ns_seconds) / base:.1f}"])
    rows.append(["muon at dp 8 (NS / 8)", f"{medians['muon - NS'] + ns_seconds / 8:.1f}",
                 f"{(medians['muon - NS'] + ns_seconds / 8) / base:.1f}"])
    print(f"Optimizer step, Llama-3 8B block x {args.layers} ({weights / 1e6:.0f}M weights, fp32), one process, "
          f"{args.threads} threads, median of {args.rounds} interleaved rounds")
    print(format_table(["step", "seconds", "x AdamW"], rows))
    print(f"Newton-Schulz (bf16, 5 steps) per block: {ns_seconds / args.layers:.1f} s, "
          f"{ns_flops_total / args.layers / 1e12:.1f} TFLOP")
    print(format_table(["matrix", "per block", "seconds", "GFLOP/s"], ns_rows))
    write_json(args.json, {"args": vars(args), "weights": weights, "step_seconds": times, "medians": medians,
                           "newton_schulz_seconds": ns_seconds, "newton_schulz_flops": ns_flops_total,
                           "newton_schulz_shapes": ns_rows})


if __name__ == "__main__":
    main()
