"""Ulysses' queries first: an attention layer's QKV projection cut so that the queries' all-to-alls fly while K
and V are projected (``Attention.queries_first``), against the fused projection, on a throttled link.

    python benchmarks/ulysses_queries.py                        # cp 2, hidden 1024, seq 2048; 1gbit, 2gbit, loopback
    python benchmarks/ulysses_queries.py --rates 1gbit --heads 16 --groups 4     # grouped-query K/V

One GPT attention layer (``models.attention.Attention``: the QKV projection, the Ulysses exchanges with
``parallel.cp_a2a_slices`` head slices, SDPA, the output projection) on 2 CP ranks in one torchrun job per link
rate (inside ``benchmarks/throttled.sh``: transfers wait on a "wire" while each rank's core computes, as NCCL's
transfers run beside a GPU's kernels). Each round runs forward + backward in each mode, the modes' order
rotating from round to round so that drift hits them alike:
  fused         the projection whole, then every exchange (the path FP8 keeps);
  queries first the queries projected and sent, then K and V projected;
  nocomm        queries first with every all-to-all a local copy of the same shape (wrong numbers, the bound).
Medians over the rounds of the slower rank's time, and of a rank's time blocked in the exchanges' waits (less
nocomm's, what the calls cost without communication): the communication the layer could not hide.
"""
from __future__ import annotations

import argparse
import contextlib
import time

from common import (add_rotating_rounds_args, add_throttled_job_args, drive_rates, format_table, forward_flags,
                    median_rows, rotating_rounds, run_harness, write_median_times)
from context_parallel import ExchangeTally, cp_exchanges, library_a2a_slices

MODES = ("queries first", "fused", "nocomm")
WORKER_FLAGS = ("hidden", "heads", "groups", "seq", "batch", "slices", "rounds", "warmup", "threads")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=None, help="K/V groups (default: one per head, MHA)")
    parser.add_argument("--seq", type=int, default=2048, help="the whole sequence (cp 2 ranks hold half each)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--slices", type=int, default=None,
                        help="head slices pipelined (parallel.cp_a2a_slices; default: the library's default)")
    add_rotating_rounds_args(parser, rates="1gbit,2gbit,none", rounds=9, warmup=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1: 2 shared cores)")
    add_throttled_job_args(parser, "ulysses_queries")
    args = parser.parse_args(argv)
    args.groups = args.groups or args.heads
    args.slices = args.slices or library_a2a_slices()
    if args.heads % args.groups or args.seq % 4 or args.hidden % args.heads:
        parser.error("--heads must be a multiple of --groups, --hidden of --heads, and --seq of 4 (cp 2 zig-zag)")
    return args


@contextlib.contextmanager
def blocked_in_exchanges(seconds: list):
    """Add to ``seconds[0]`` the time spent in the Ulysses exchanges' waits (forward and backward)."""
    from megatron_domino.models import ulysses
    start_exchange = ulysses._start

    class TimedWork:
        def __init__(self, work):
            self.work = work

        def wait(self):
            begun = time.perf_counter()
            try:
                return self.work.wait()
            finally:
                seconds[0] += time.perf_counter() - begun

    def timed_start(blocks, group):
        out, work, sent = start_exchange(blocks, group)
        return out, TimedWork(work), sent
    ulysses._start = timed_start
    try:
        yield
    finally:
        ulysses._start = start_exchange


def _attention(args):
    import torch
    import torch.distributed as dist
    from megatron_domino.config import ModelConfig
    from megatron_domino.models.attention import Attention
    from megatron_domino.tensor_parallel.context import LayerContext
    cfg = ModelConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads,
                      num_query_groups=args.groups, ffn_hidden_size=4 * args.hidden, seq_length=args.seq,
                      vocab_size=256)
    ctx = LayerContext(cp_group=dist.new_group(list(range(2))), cp_comm="a2a", cp_a2a_slices=args.slices)
    attention = Attention(cfg, ctx)
    torch.manual_seed(0)  # the same weights on both ranks, as CP keeps them
    for param in attention.parameters():
        param.data.normal_(0.0, 0.02)
    return attention


def _pass(attention, mode: str, x, grad) -> tuple[float, float]:
    """(seconds until both ranks are done, seconds this rank was blocked in exchange waits) of forward + backward."""
    import torch.distributed as dist
    attention.queries_first = mode != "fused"
    attention.zero_grad(set_to_none=True)
    blocked = [0.0]
    dist.barrier()
    with cp_exchanges(ExchangeTally(), skip=mode == "nocomm"), blocked_in_exchanges(blocked):
        start = time.perf_counter()
        attention.hidden(x).backward(grad)
        dist.barrier()
        return time.perf_counter() - start, blocked[0]


def local_inputs(args, rank: int):
    """(this CP rank's tokens of one random [batch, seq, hidden] input, a gradient for its output): the same
    whole sequence on both ranks, each holding its zig-zag chunks."""
    import torch
    from megatron_domino.models.ring_attention import local_positions
    generator = torch.Generator().manual_seed(1)
    whole = torch.randn(args.batch, args.seq, args.hidden, generator=generator)
    x = whole.index_select(1, local_positions(args.seq, 2, rank)).requires_grad_()
    return x, torch.randn(args.batch, args.seq // 2, args.hidden, generator=generator)  # heads x head dim


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    attention, rank = _attention(args), dist.get_rank()
    x, grad = local_inputs(args, rank)
    timings = rotating_rounds(MODES, args.rounds, args.warmup, lambda mode: _pass(attention, mode, x, grad))
    write_median_times(args.json, args, timings)
    dist.destroy_process_group()


def report(rate: str, data: dict) -> str:
    a = data["args"]
    return "\n".join([
        f"link {rate}: attention at cp 2 (a2a, {a['slices']} head slices), hidden {a['hidden']}, {a['heads']} heads, "
        f"{a['groups']} K/V groups, seq {a['seq']}, batch {a['batch']}; median of {a['rounds']} rounds",
        format_table(["mode", "fwd+bwd ms", "/ fused", "blocked ms"], median_rows(data, MODES, "fused"))])


def drive(args) -> None:
    drive_rates(args, __file__, 2, forward_flags(args, WORKER_FLAGS), report)


if __name__ == "__main__":
    run_harness(parse_args(), worker, drive)
