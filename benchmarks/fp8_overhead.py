"""FP8 (``model.fp8``) against the weights' dtype on the CPU: training tokens/s of a GPT per recipe, and the time
FP8 spends quantising (amaxes, scales, casts, the transposed copies of the backward) as a share of the step.

    python benchmarks/fp8_overhead.py                   # 12 layers, hidden 768, seq 512, micro batch 2, vocab 32000
    python benchmarks/fp8_overhead.py --hidden 64 --heads 4 --layers 2 --seq 64 --vocab 256 --rounds 1 --block 32
    python benchmarks/fp8_overhead.py --compile         # also off and tensorwise with model.compile (compiled casts)

One process holds a Trainer per mode (the same seed and mock data) and steps them in interleaved rounds after
``--warmup`` untimed steps each. Quantisation is timed around ``LinearScaling``'s own methods (on the CPU every op
is synchronous, so wall time is the op's time). The CPU has no FP8 arithmetic: ``torch._scaled_mm`` converts the
operands and multiplies in fp32 (blockwise: once per tile column), so FP8 is slower here, by design of the
hardware, not of the recipe; what this measures is the overhead FP8 adds around the GEMMs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from common import (RESULTS, add_model_args, build_trainer, format_table, load_benchmark_config, model_overrides,
                    write_json)

MODES = ("off", "tensorwise", "delayed", "blockwise")
TIMED = ("scale", "_tensorwise", "_tiles")  # LinearScaling's methods that quantise (amax, scale, cast, copy)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=768, heads=12, layers=12, seq=512, micro_batch=2, vocab=32000)
    parser.add_argument("--block", type=int, default=64, help="model.fp8_block_size for blockwise (default 64)")
    parser.add_argument("--compile", action="store_true",
                        help="also off and tensorwise with model.compile: the casts and amaxes as compiled kernels")
    parser.add_argument("--rounds", type=int, default=2, help="timed steps of each mode (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each mode first")
    parser.add_argument("--json", default=os.path.join(RESULTS, "fp8_overhead.json"))
    return parser.parse_args(argv)


class QuantisationClock:
    """Seconds spent in ``LinearScaling``'s quantising methods (the outermost call counts: ``_tiles`` and
    ``_tensorwise`` call no other timed method, ``scale`` neither)."""

    def __init__(self):
        from megatron_domino.fp8.scaling import LinearScaling
        self.seconds, self.originals = 0.0, {name: getattr(LinearScaling, name) for name in TIMED}
        for name, method in self.originals.items():
            setattr(LinearScaling, name, self._timed(method))

    def _timed(self, method):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return call

    def lap(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def main(args) -> None:
    import torch
    torch.set_num_threads(args.threads)
    overrides = model_overrides(args, "fp8_overhead") + [
        "parallel.tp=1", "parallel.pp=1", "parallel.domino=false", "optimizer.lr_schedule=constant",
        f"train.global_batch_size={args.micro_batch}", f"model.fp8_block_size={args.block}"]
    modes = MODES + (("off+compile", "tensorwise+compile") if args.compile else ())
    trainers = {mode: build_trainer(load_benchmark_config(
        overrides + [f"model.fp8={'null' if mode.startswith('off') else mode.split('+')[0]}",
                     f"model.compile={str(mode.endswith('+compile')).lower()}"])) for mode in modes}
    clock = QuantisationClock()
    seconds, quantising, losses = ({mode: [] for mode in modes} for _ in range(3))
    for round_index in range(args.warmup + args.rounds):
        for mode in modes if round_index % 2 == 0 else modes[::-1]:
            clock.lap()
            start = time.perf_counter()
            losses[mode].append(trainers[mode].train_step()["loss"].item())
            seconds[mode].append(time.perf_counter() - start)
            quantising[mode].append(clock.lap())
    for trainer in trainers.values():
        trainer.close()
    median = {mode: statistics.median(seconds[mode][args.warmup:]) for mode in modes}
    share = {mode: statistics.median(q / s for q, s in zip(quantising[mode][args.warmup:],
                                                          seconds[mode][args.warmup:])) for mode in modes}
    tokens = args.micro_batch * args.seq
    rows = [[mode, f"{tokens / median[mode]:.0f}", f"{median['off'] / median[mode]:.3f}", f"{median[mode]:.2f}",
             f"{share[mode]:.1%}", f"{losses[mode][-1]:.4f}"] for mode in modes]
    print(f"FP8 on the CPU: hidden {args.hidden}, heads {args.heads}, layers {args.layers}, seq {args.seq}, micro "
          f"batch {args.micro_batch}, vocab {args.vocab}, {'bf16' if args.bf16 else 'fp32'} weights, AdamW, "
          f"{args.threads} thread(s); blockwise tiles of {args.block}; median of {args.rounds} rounds\n")
    print(format_table(["model.fp8", "tokens/s", "vs off", "step s", "quantising share", "last loss"], rows))
    record = dict(args=vars(args), seconds=seconds, quantising=quantising, losses=losses)
    print(f"results: {write_json(args.json, record)}")


if __name__ == "__main__":
    main(parse_args())
