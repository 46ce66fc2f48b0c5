"""Framework overhead: a megatron_domino training step at tp = pp = dp = 1 against plain PyTorch.

    python benchmarks/overhead.py          # target: framework / plain <= 1.05

One process holds both: a Trainer (ZeRO-0, fp32, AdamW, constant LR, mock data) and the same GPT in
plain PyTorch (benchmarks/plain_pytorch_gpt.py: nn.Linear, F.scaled_dot_product_attention, F.layer_norm,
F.cross_entropy, torch.optim.AdamW, clip_grad_norm_) with the same hyper-parameters. The plain model
starts from the framework's initial weights (loaded by name) and reads the same batches through the
framework's data loader, so every step's loss must agree: the ratio is printed for the same computation.
Steps are timed in interleaved rounds (the order alternates every round) and medians reported, also per
phase: data, forward + backward, optimizer (the Trainer's own timers; the same split in the plain loop).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from common import RESULTS, add_model_args, build_trainer, format_table, load_benchmark_config, \
    model_overrides, write_json

PHASES = ("data", "forward-backward", "optimizer")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=512, heads=8, layers=4, seq=256, micro_batch=8)
    parser.add_argument("--rounds", type=int, default=10, help="timed steps of each (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each first")
    parser.add_argument("--json", default=os.path.join(RESULTS, "overhead.json"))
    args = parser.parse_args(argv)
    if args.vocab % 128:
        parser.error(f"--vocab {args.vocab}: must be a multiple of 128 so the framework pads nothing "
                     f"(the plain model has no padded rows). Fix: use 1024.")
    if args.bf16:
        parser.error("--bf16: the comparison is fp32 (plain PyTorch has no fp32 master weights). Fix: drop it.")
    return args


def plain_setup(cfg, trainer):
    """The plain model with the framework's initial weights, its optimizer, and a loader of the same batches."""
    import plain_pytorch_gpt as plain
    from megatron_domino.data import MicroBatchLoader, build_train_valid_test_datasets
    model, opt, train = cfg.model, cfg.optimizer, cfg.train
    gpt = plain.PlainGPT(model.vocab_size, model.hidden_size, model.num_attention_heads, model.num_layers,
                         model.seq_length, model.norm_eps, model.init_std)
    gpt.load_state_dict(trainer.chunks[0].state_dict(), strict=True)
    optimizer = plain.make_optimizer(gpt, opt.lr, (opt.beta1, opt.beta2), opt.eps, opt.weight_decay)
    dataset = build_train_valid_test_datasets(cfg, (train.steps * train.global_batch_size, 0, 0))[0]
    loader = MicroBatchLoader(dataset, train.global_batch_size, train.micro_batch_size, 0, 1)
    return plain, gpt, optimizer, loader


def plain_step(plain, gpt, optimizer, loader, clip: float) -> tuple[float, dict]:
    start = time.perf_counter()
    batch = loader.next_step()[0]
    if not bool((batch["loss_mask"] == 1).all()):
        raise RuntimeError("the mock batch masks some tokens but the plain loss is a plain mean. "
                           "Fix: data.eod_mask_loss=false")
    loaded = time.perf_counter()
    loss = plain.forward_backward(gpt, batch["tokens"], batch["labels"]).item()
    computed = time.perf_counter()
    plain.optimizer_step(gpt, optimizer, clip)
    end = time.perf_counter()
    return loss, {"data": loaded - start, "forward-backward": computed - loaded, "optimizer": end - computed}


def framework_step(trainer) -> tuple[float, dict]:
    loss = trainer.train_step()["loss"].item()
    return loss, {name: ms / 1e3 for name, ms in trainer.timers.report().items()}


def main() -> None:
    import torch
    args = parse_args()
    torch.set_num_threads(args.threads)
    overrides = model_overrides(args, "overhead") + [
        "parallel.tp=1", "parallel.pp=1", "parallel.domino=false", "optimizer.zero_stage=0",
        "optimizer.lr_schedule=constant", "data.eod_mask_loss=false",
        f"train.global_batch_size={args.micro_batch}", "train.steps=1000"]
    cfg = load_benchmark_config(overrides)
    trainer = build_trainer(cfg)
    plain, gpt, optimizer, loader = plain_setup(cfg, trainer)
    run_plain = lambda: plain_step(plain, gpt, optimizer, loader, cfg.optimizer.clip_grad)  # noqa: E731
    run_framework = lambda: framework_step(trainer)  # noqa: E731
    samples = {"framework": [], "plain": []}
    losses = {"framework": [], "plain": []}
    for round_index in range(args.warmup + args.rounds):
        order = [("framework", run_framework), ("plain", run_plain)]
        for name, run in order if round_index % 2 == 0 else order[::-1]:
            start, cpu = time.perf_counter(), time.process_time()
            loss, phases = run()
            total, cpu = time.perf_counter() - start, time.process_time() - cpu
            losses[name].append(loss)
            if round_index >= args.warmup:
                samples[name].append({"total": total, "cpu": cpu, **phases})
    trainer.close()
    result = summarize(args, samples, losses)
    print(report(result))
    print(f"results: {write_json(args.json, result)}")


def summarize(args, samples: dict, losses: dict) -> dict:
    medians = {name: {key: statistics.median(s[key] for s in runs) for key in ("total", "cpu", *PHASES)}
               for name, runs in samples.items()}
    deviation = [abs(a - b) for a, b in zip(losses["framework"], losses["plain"])]
    return {"args": vars(args), "median_s": medians, "samples": samples, "losses": losses,
            "first_loss_abs_deviation": deviation[0], "loss_max_abs_deviation": max(deviation),
            "ratio": medians["framework"]["total"] / medians["plain"]["total"],
            "ratio_cpu": medians["framework"]["cpu"] / medians["plain"]["cpu"]}


def report(result: dict) -> str:
    a, medians = result["args"], result["median_s"]
    keys = ("total", "cpu", *PHASES)
    rows = [[name, *(f"{medians[name][key] * 1e3:.1f}" for key in keys)] for name in medians]
    rows.append(["framework - plain", *(f"{(medians['framework'][k] - medians['plain'][k]) * 1e3:+.1f}"
                                        for k in keys)])
    return "\n".join([
        f"Framework overhead at tp = pp = dp = 1: GPT hidden {a['hidden']}, heads {a['heads']}, layers {a['layers']}, "
        f"seq {a['seq']}, batch {a['micro_batch']}, fp32, AdamW, {a['threads']} thread(s); "
        f"median of {a['rounds']} interleaved rounds",
        f"same computation: |loss_framework - loss_plain| = {result['first_loss_abs_deviation']:.2e} at the first "
        f"step (loss {result['losses']['plain'][0]:.4f}), at most {result['loss_max_abs_deviation']:.2e} over "
        f"{len(result['losses']['plain'])} steps",
        format_table(["", "step ms", "CPU ms", "data ms", "fwd+bwd ms", "optimizer ms"], rows),
        f"ratio framework / plain = {result['ratio']:.3f} wall clock (target <= 1.05), {result['ratio_cpu']:.3f} "
        f"in process CPU time (all threads; steadier than wall clock on a loaded machine)"])


if __name__ == "__main__":
    main()
