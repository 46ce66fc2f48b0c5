"""Ulysses' output all-to-alls across Domino's μ-chunks (``parallel.cp_a2a_output_overlap``): the attention core a
phase of its own, so that a μ-chunk's output exchange flies during the next μ-chunk's core, against Domino's
usual order, on a throttled link.

    python benchmarks/ulysses_domino.py                  # cp 2, hidden 1024, 2 layers, seq 2048, 2 μ-chunks
    python benchmarks/ulysses_domino.py --tp 2 --layers 1 --rates 1gbit,2gbit        # with Domino's all-reduces

A stack of GPT blocks (``models.block.TransformerBlock``) run by Domino's executor (``domino.executor.run_order``)
over 2 μ-chunks at cp 2 (a2a), in one torchrun job per link rate (inside ``benchmarks/throttled.sh``: transfers
wait on a "wire" while each rank's core computes). At tp 1 (2 ranks) Domino has no all-reduce of its own, so
this isolates the Ulysses exchanges; ``--tp 2`` (4 ranks on these 2 cores, noisier) adds the TP side of the
trade: the projection's all-reduce hiding behind the other chunk's projection instead of its whole attention.
Each round runs forward + backward in each mode, the order rotating:
  usual   Domino's order: a μ-chunk's attention, its output exchange waited for, then its projection;
  apart   the cores of both μ-chunks first (chunk 0's output exchange in flight during chunk 1's core);
  nocomm  apart with every all-to-all a local copy of the same shape (wrong numbers, the bound).
Medians over the rounds of the slower rank's time, and of a rank's time blocked in the exchanges' waits (less
nocomm's).
"""
from __future__ import annotations

import argparse
import time

from common import (add_rotating_rounds_args, add_throttled_job_args, drive_rates, format_table, forward_flags,
                    median_rows, rotating_rounds, run_harness, write_median_times)
from context_parallel import ExchangeTally, cp_exchanges
from ulysses_queries import blocked_in_exchanges, local_inputs

MODES = ("apart", "usual", "nocomm")
WORKER_FLAGS = ("hidden", "heads", "layers", "tp", "seq", "batch", "rounds", "warmup", "threads")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2),
                        help="TP ranks per CP rank (2: 4 ranks on these 2 cores, Domino's all-reduces in the trade)")
    parser.add_argument("--seq", type=int, default=2048, help="the whole sequence (cp 2 ranks hold half each)")
    parser.add_argument("--batch", type=int, default=2, help="samples per micro-batch (Domino: one per μ-chunk)")
    add_rotating_rounds_args(parser, rates="1gbit,2gbit,none", rounds=9, warmup=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1: 2 shared cores)")
    add_throttled_job_args(parser, "ulysses_domino")
    args = parser.parse_args(argv)
    if args.batch < 2 or args.seq % 4 or args.hidden % args.heads or args.heads % (2 * args.tp):
        parser.error("--batch must be at least 2 (two μ-chunks), --seq a multiple of 4, and --heads a multiple of "
                     "2 x tp and a divisor of --hidden")
    return args


def _blocks(args):
    """The blocks of this rank: rank r is TP rank r % tp of CP rank r // tp (the library's tp-cp order)."""
    import torch
    import torch.distributed as dist
    from megatron_domino.config import ModelConfig
    from megatron_domino.models.block import TransformerBlock
    from megatron_domino.tensor_parallel.context import LayerContext
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      ffn_hidden_size=4 * args.hidden, seq_length=args.seq, vocab_size=256)
    rank, tp = dist.get_rank(), args.tp
    tp_groups = [dist.new_group([c * tp + t for t in range(tp)]) for c in range(2)]
    cp_groups = [dist.new_group([t, tp + t]) for t in range(tp)]
    ctx = LayerContext(group=tp_groups[rank // tp] if tp > 1 else None, cp_group=cp_groups[rank % tp],
                       cp_comm="a2a", grad_pieces=1)
    blocks = torch.nn.ModuleList(TransformerBlock(cfg, ctx, layer_number=i + 1) for i in range(args.layers))
    torch.manual_seed(0)  # the same weights on both ranks, as CP keeps them
    for param in blocks.parameters():
        param.data.normal_(0.0, 0.02)
    return blocks


def _pass(blocks, mode: str, x, grad) -> tuple[float, float]:
    """(seconds until both ranks are done, seconds this rank was blocked in exchange waits) of forward + backward."""
    import torch
    import torch.distributed as dist
    from megatron_domino.domino.executor import run_order
    from megatron_domino.domino.order import forward_order
    from megatron_domino.models.tokens import NO_CONTEXT
    blocks.zero_grad(set_to_none=True)
    half = x.shape[0] // 2
    order = forward_order(len(blocks), 2, "inter", attention_apart=mode != "usual")
    blocked = [0.0]
    dist.barrier()
    with cp_exchanges(ExchangeTally(), skip=mode == "nocomm"), blocked_in_exchanges(blocked):
        start = time.perf_counter()
        outs = run_order(order, blocks, [x[:half], x[half:]], [NO_CONTEXT, NO_CONTEXT])
        torch.cat(outs).backward(grad)
        dist.barrier()
        return time.perf_counter() - start, blocked[0]


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    blocks, rank = _blocks(args), dist.get_rank()
    x, grad = local_inputs(args, rank // args.tp)
    timings = rotating_rounds(MODES, args.rounds, args.warmup, lambda mode: _pass(blocks, mode, x, grad))
    write_median_times(args.json, args, timings)
    dist.destroy_process_group()


def report(rate: str, data: dict) -> str:
    a = data["args"]
    return "\n".join([
        f"link {rate}: {a['layers']} GPT blocks at cp 2 (a2a), Domino's 2 μ-chunks at tp {a.get('tp', 1)}, "
        f"hidden {a['hidden']}, "
        f"{a['heads']} heads, seq {a['seq']}, batch {a['batch']}; median of {a['rounds']} rounds",
        format_table(["mode", "fwd+bwd ms", "/ usual", "blocked ms"], median_rows(data, MODES, "usual"))])


def drive(args) -> None:
    drive_rates(args, __file__, 2 * args.tp, forward_flags(args, WORKER_FLAGS), report)


if __name__ == "__main__":
    run_harness(parse_args(), worker, drive)
