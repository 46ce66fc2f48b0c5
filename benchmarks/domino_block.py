"""Domino vs synchronous TP vs no communication: fwd+bwd of a TP=2 transformer block stack.

Run on a throttled loopback so communication waits on the wire instead of competing for the
two CPU cores (on the raw loopback nothing can overlap):

    benchmarks/throttled.sh --rate 1gbit -- \
        python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/domino_block.py

(from the repository root, as root: see benchmarks/throttled.sh).

Modes are measured in interleaved rounds (sync, row-intra, row-inter, column, 2d, nocomm, sync, ...)
so that drift on a shared machine hits them alike. Printed per mode: median time, speed-up
over sync, and the hidden fraction (T_sync - T_mode) / (T_sync - T_nocomm). The share of sync
step time spent in communication is (T_sync - T_nocomm) / T_sync.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from megatron_domino.config import ModelConfig
from megatron_domino.domino.executor import run_order
from megatron_domino.domino.order import forward_order
from megatron_domino.domino.plan import COMPARED_PLANS
from megatron_domino.models import TransformerBlock, initialize_weights
from megatron_domino.models.tokens import NO_CONTEXT
from megatron_domino.parallel.launch import shutdown_distributed
from megatron_domino.tensor_parallel import LayerContext

from common import tp_communication_skipped

MODES = {**COMPARED_PLANS, "nocomm": COMPARED_PLANS["sync"]}  # nocomm: sync with every TP all-reduce skipped


class BlockStack(torch.nn.Module):
    """Blocks only (no embedding or head): what TP and Domino change."""

    def __init__(self, cfg, group, plan):
        super().__init__()
        self.plan, self.group = plan, group
        ctx = LayerContext(group, grad_pieces=plan.grad_pieces)
        self.layers = torch.nn.ModuleList(TransformerBlock(cfg, ctx, layer_number=i) for i in range(cfg.num_layers))

    def forward(self, x):
        if not self.plan.enabled:
            for block in self.layers:
                x = block(x)
            return x
        rows, columns = self.plan.split_for(x.shape[0])
        order = forward_order(len(self.layers), rows, self.plan.overlap)
        out = run_order(order, self.layers, list(x.tensor_split(rows, dim=0)), [NO_CONTEXT] * rows,
                        column_pieces=columns)
        return torch.cat(out, dim=0)


def time_mode(stack, x, grad, mode: str, forward_only: bool = False) -> float:
    dist.barrier()
    start = time.perf_counter()
    with tp_communication_skipped(stack.group) if mode == "nocomm" else contextlib.nullcontext():
        if forward_only:
            with torch.no_grad():
                stack(x)
        else:
            stack(x).backward(grad)
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--forward-only", action="store_true", help="time the forward pass alone")
    parser.add_argument("--json", default="benchmarks/results/domino_block.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    tp = dist.get_world_size()
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      seq_length=args.seq)
    stacks = {}
    for mode, plan in MODES.items():
        stacks[mode] = BlockStack(cfg, group, plan)
        initialize_weights(stacks[mode], seed=1, tp_rank=rank, tp=tp)
    x = torch.randn(args.batch, args.seq, args.hidden, requires_grad=True)
    grad = torch.randn_like(x)
    times = {mode: [] for mode in MODES}
    for mode in MODES:  # warm-up
        time_mode(stacks[mode], x, grad, mode, args.forward_only)
    for _ in range(args.rounds):
        for mode in MODES:
            times[mode].append(time_mode(stacks[mode], x, grad, mode, args.forward_only))
    if rank == 0:
        report(times, args, tp)
    shutdown_distributed()


def report(times, args, tp) -> None:
    median = {mode: statistics.median(values) for mode, values in times.items()}
    t_sync, t_free = median["sync"], median["nocomm"]
    exposed = t_sync - t_free
    print(f"TP={tp} block stack {'fwd' if args.forward_only else 'fwd+bwd'}: layers {args.layers}, "
          f"hidden {args.hidden}, seq {args.seq}, batch {args.batch}, {args.rounds} rounds (median)")
    print(f"communication share of sync step time: {exposed / t_sync:.1%}")
    print(f"{'mode':<10} {'time ms':>9} {'speed-up':>9} {'hidden':>8}")
    rows = []
    for mode, t in median.items():
        hidden = (t_sync - t) / exposed if exposed > 0 else float("nan")
        print(f"{mode:<10} {t * 1000:>9.1f} {t_sync / t:>9.3f} {hidden:>8.2f}")
        rows.append({"mode": mode, "time_s": t, "speedup": t_sync / t, "hidden_fraction": hidden,
                     "samples_s": times[mode]})
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"args": vars(args), "tp": tp, "comm_share_sync": exposed / t_sync, "modes": rows}, f, indent=1)


if __name__ == "__main__":
    main()
