"""Context parallelism's three communication styles side by side: attention forward+backward time and exposed
communication at cp 4 on a throttled link.

    python benchmarks/context_parallel.py                          # cp 4, seq 1024 and 4096, 1 and 4 gbit (~2.5 min)
    python benchmarks/context_parallel.py --seqs 16384 --rates 1gbit --rounds 5     # ~4 min

One torchrun job of cp ranks per link rate (inside benchmarks/throttled.sh, so transfers wait on a "wire"
instead of fighting compute for the two cores). A rank holds its part of one sequence, as the model's layout
gives it (``ring_attention.local_positions``), and times the attention core with its CP exchange, forward then
backward, through the library's public pieces:
  ring       ring_attention over all cp ranks (K/V blocks around the ring, each hop behind a block's compute)
  a2a        ulysses_attention over all cp ranks (4 all-to-alls each way per head slice; --a2a-slices as
             parallel.cp_a2a_slices), SDPA on the whole sequence
  a2a+ring   ulysses_attention in groups of --a2a-size consecutive ranks, ring_attention across the groups
Each style also runs with its exchange replaced by a local copy of the same shape (``cp_exchanges(skip=True)``):
the same kernels on the same shapes, no communication. Exposed communication = T_style - T_style-no-comm; the
styles and their no-comm twins run in interleaved rounds (medians), so drift hits all alike. The ring hides its
hops only if its per-step compute (T_no-comm / cp) lasts longer than a step's transfers on the wire; the header
line of each size says which.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import time

from common import add_throttled_job_args, forward_flags, launch, read_json, run_harness, write_json

STYLES = ("ring", "a2a", "a2a+ring")
WORKER_FLAGS = ("cp", "a2a_size", "a2a_slices", "seqs", "heads", "head_dim", "batch", "rounds", "warmup", "threads")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, default=4, help="context-parallel ranks (one torchrun job)")
    parser.add_argument("--a2a-size", type=int, default=2, help="a2a+ring: ranks per all-to-all group")
    parser.add_argument("--a2a-slices", type=int, default=None,
                        help="a2a: head slices pipelined (parallel.cp_a2a_slices; default: the library's default)")
    parser.add_argument("--seqs", default="1024,4096", help="sequence lengths, comma-separated (whole sequence)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (MHA: K/V heads = heads)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="sequences per pass")
    parser.add_argument("--rates", default="1gbit,4gbit", help="link rates for throttled.sh; 'none': raw loopback")
    parser.add_argument("--rounds", type=int, default=7, help="timed passes per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed passes per variant first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1: 2 shared cores)")
    add_throttled_job_args(parser, "context_parallel")
    args = parser.parse_args(argv)
    if args.a2a_slices is None:
        args.a2a_slices = library_a2a_slices()
    for seq in map(int, args.seqs.split(",")):
        if args.cp % args.a2a_size or args.heads % args.cp or seq % (2 * args.cp * args.a2a_size):
            parser.error(f"--seqs {seq}, --heads {args.heads}, --cp {args.cp}, --a2a-size {args.a2a_size}: the heads "
                         f"must divide by cp, cp by the a2a size, and seq by 2 x cp x a2a size")
    return args


def library_a2a_slices() -> int:
    """The head slices a2a pipelines by default (``parallel.cp_a2a_slices``)."""
    from megatron_domino.config.schema import ParallelConfig
    return ParallelConfig().cp_a2a_slices


# ----- the exchanges, counted and (for the no-comm twin) skipped -----------------------------------------------
class ExchangeTally:
    """The CP exchanges one pass issued (all-to-alls and batched send/receive pairs) and the bytes this rank sent;
    ``skipped`` counts those replaced by a local copy."""

    def __init__(self):
        self.calls = self.skipped = self.bytes_sent = 0


class _Done:
    """The handle of a skipped asynchronous collective: already complete."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def cp_exchanges(tally: ExchangeTally, skip: bool):
    """Count every all-to-all and batched send/receive; with ``skip`` each becomes a local copy of the same shape
    (an all-to-all keeps its own blocks, a ring hop receives the block it sent): the kernels then run on the same
    shapes with no communication, and the results are wrong."""
    import torch.distributed as dist
    all_to_all, batch = dist.all_to_all_single, dist.batch_isend_irecv

    def counted_all_to_all(output, input, *args, group=None, **kwargs):
        tally.calls += 1
        tally.bytes_sent += input.numel() * input.element_size() * (1 - 1 / dist.get_world_size(group))
        if not skip:
            return all_to_all(output, input, *args, group=group, **kwargs)
        tally.skipped += 1
        output.copy_(input)
        return _Done() if kwargs.get("async_op") else None

    def counted_batch(ops):
        tally.calls += 1
        sends = [op.tensor for op in ops if op.op is dist.isend]
        tally.bytes_sent += sum(t.numel() * t.element_size() for t in sends)
        if not skip:
            return batch(ops)
        tally.skipped += 1
        for sent, buffer in zip(sends, [op.tensor for op in ops if op.op is dist.irecv]):
            buffer.copy_(sent)
        return []  # nothing to wait for

    dist.all_to_all_single, dist.batch_isend_irecv = counted_all_to_all, counted_batch
    try:
        yield tally
    finally:
        dist.all_to_all_single, dist.batch_isend_irecv = all_to_all, batch


# ----- the worker: one rank of the cp group ---------------------------------------------------------------------
def attention_styles(cp: int, a2a: int, slices: int) -> dict:
    """Per style: (the token layout's a2a group size, attention(q, k, v) of this rank's tokens), built as
    ``attention.context_parallel_attention`` builds them from a LayerContext."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron_domino.models.ring_attention import Ring, ring_attention
    from megatron_domino.models.ulysses import Ulysses, ulysses_attention
    rank = dist.get_rank()
    every = dist.new_group(list(range(cp)))
    a2a_groups = [dist.new_group(list(range(g * a2a, (g + 1) * a2a))) for g in range(cp // a2a)]
    ring_groups = [dist.new_group(list(range(u, cp, a2a))) for u in range(a2a)]  # one member of every a2a group
    group_index, member = divmod(rank, a2a)
    pipelined = {"slices": slices} if slices != 1 else {}  # as the library's a2a; its a2a+ring has one slice
    ring, ulysses = Ring(every, rank, cp), Ulysses(every, cp, cp, **pipelined)
    inner = Ulysses(a2a_groups[group_index], a2a, cp, first=group_index * a2a, layout=a2a)
    outer = Ring(ring_groups[member], group_index, cp // a2a)
    causal = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    return {"ring": (1, lambda q, k, v: ring_attention(q, k, v, ring)),
            "a2a": (1, lambda q, k, v: ulysses_attention(q, k, v, ulysses, causal)),
            "a2a+ring": (a2a, lambda q, k, v: ulysses_attention(
                q, k, v, inner, lambda q, k, v: ring_attention(q, k, v, outer)))}


def timed_pass(attend, inputs, grad, tally: ExchangeTally, skip: bool):
    """One forward+backward, all ranks started together and timed until all are done: (seconds, output)."""
    import torch.distributed as dist
    for tensor in inputs:
        tensor.grad = None
    dist.barrier()
    start = time.perf_counter()
    with cp_exchanges(tally, skip):
        out = attend(*inputs)
        out.backward(grad)
    dist.barrier()
    return time.perf_counter() - start, out.detach()


def measure_size(args, seq: int, styles: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron_domino.models.ring_attention import local_positions
    cp, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(seq)  # the same whole sequence on every rank
    q, k, v, grad = (torch.randn(args.batch, args.heads, seq, args.head_dim, generator=generator) for _ in range(4))
    variants = [(style, skip) for style in styles for skip in (False, True)]
    local = {}
    for style, (layout, _) in styles.items():
        positions = local_positions(seq, cp, rank, a2a=layout)
        local[style] = ([t.index_select(2, positions).requires_grad_() for t in (q, k, v)],
                        grad.index_select(2, positions), positions)
    times, tallies, outputs = {v: [] for v in variants}, {}, {}
    for round_index in range(args.warmup + args.rounds):
        for style, skip in variants:
            inputs, grad_out, _ = local[style]
            tally = ExchangeTally()
            seconds, outputs[style, skip] = timed_pass(styles[style][1], inputs, grad_out, tally, skip)
            tallies[style, skip] = tally
            if round_index >= args.warmup:
                times[style, skip].append(seconds)
    errors = torch.zeros(len(variants))  # max |output - single-process attention| over this rank's tokens
    for index, (style, skip) in enumerate(variants):
        positions = local[style][2]
        mask = torch.arange(seq)[None, :] <= positions[:, None]
        expected = F.scaled_dot_product_attention(q.index_select(2, positions), k, v, attn_mask=mask)
        errors[index] = (outputs[style, skip] - expected).abs().max()
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    rows = []
    for index, (style, skip) in enumerate(variants):
        tally = tallies[style, skip]
        rows.append({"style": style, "no_comm": skip, "median_s": statistics.median(times[style, skip]),
                     "samples_s": times[style, skip], "exchanges": tally.calls, "skipped": tally.skipped,
                     "mb_sent_per_rank": tally.bytes_sent / 1e6, "max_error": errors[index].item()})
    return {"seq": seq, "rows": rows}


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    if dist.get_world_size() != args.cp:
        raise SystemExit(f"--cp {args.cp} but {dist.get_world_size()} ranks")
    styles = attention_styles(args.cp, args.a2a_size, args.a2a_slices)
    sizes = [measure_size(args, int(seq), styles) for seq in args.seqs.split(",")]
    if dist.get_rank() == 0:
        result = {"rate": args.rate, "args": vars(args), "sizes": [summarize(s, args.rate) for s in sizes]}
        print(report([result]), flush=True)
        write_json(args.json, result)
    dist.destroy_process_group()


# ----- the summary and the table ---------------------------------------------------------------------------------
def bits_per_second(rate: str) -> float | None:
    """tc's rate spelling (1gbit, 500mbit, 100kbit; decimal prefixes) in bits per second; None for 'none'."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    return None if match is None else float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]]


def summarize(size: dict, rate: str) -> dict:
    """Per style: time, no-comm time, exposed communication, their ratios to the ring's, and the wire time of all
    ranks' bytes at ``rate`` (the link is shared); the ring's per-step compute against its per-step wire time."""
    link = bits_per_second(rate)
    by = {(r["style"], r["no_comm"]): r for r in size["rows"]}
    styles = []
    for style in STYLES:
        comm, bare = by[style, False], by[style, True]
        styles.append({"style": style, "ms": comm["median_s"] * 1e3, "no_comm_ms": bare["median_s"] * 1e3,
                       "exposed_ms": (comm["median_s"] - bare["median_s"]) * 1e3,
                       "mb_sent_per_rank": comm["mb_sent_per_rank"], "exchanges": comm["exchanges"],
                       "no_comm_exchanges_skipped": bare["skipped"], "comm_exchanges_skipped": comm["skipped"],
                       "max_error": comm["max_error"], "no_comm_max_error": bare["max_error"],
                       "samples_ms": [s * 1e3 for s in comm["samples_s"]],
                       "no_comm_samples_ms": [s * 1e3 for s in bare["samples_s"]]})
    ring = styles[0]
    for row in styles:
        row["vs_ring"] = row["ms"] / ring["ms"]
        row["exposed_vs_ring"] = row["exposed_ms"] / ring["exposed_ms"] if ring["exposed_ms"] > 0 else float("nan")
    return {"seq": size["seq"], "styles": styles, "link_bits_per_s": link}


def ring_steps(summary: dict, cp: int) -> tuple[float, float | None]:
    """The ring's compute per step (no-comm time / cp) and its transfers' wire time per step (all cp ranks' bytes
    over the shared link / cp), ms; the ring hides its hops only where the first is the larger."""
    ring, link = summary["styles"][0], summary["link_bits_per_s"]
    wire = None if link is None else cp * ring["mb_sent_per_rank"] * 8e6 / link * 1e3 / cp
    return ring["no_comm_ms"] / cp, wire


def report(results: list[dict]) -> str:
    a = results[0]["args"]
    headers = ["link", "seq", "style", "fwd+bwd ms", "no-comm ms", "exposed ms", "vs ring", "exposed vs ring",
               "MB sent / rank", "exchanges", "max error"]
    lines = [f"Attention forward+backward at cp {a['cp']} (a2a: {a['a2a_slices']} head slice(s) pipelined at most; "
             f"a2a+ring: groups of {a['a2a_size']}), {a['heads']} heads x "
             f"{a['head_dim']}, batch {a['batch']}, fp32, {a['threads']} thread(s) per rank; median of {a['rounds']} "
             f"interleaved rounds after {a['warmup']} warm-up; exposed = T - T_no-comm; exchanges: "
             f"all-to-alls and ring hops per pass; max error against one process (no-comm: wrong by design)", ""]
    rows = []
    for result in results:
        for size in result["sizes"]:
            compute, wire = ring_steps(size, a["cp"])
            verdict = "" if wire is None else (f"; the ring {'hides' if compute > wire else 'cannot hide'} its hops: "
                                               f"{compute:.1f} ms compute per step vs {wire:.1f} ms on the wire")
            lines.append(f"- {result['rate']}, seq {size['seq']}{verdict}")
            rows += [[result["rate"], str(size["seq"]), s["style"], f"{s['ms']:.1f}", f"{s['no_comm_ms']:.1f}",
                      f"{s['exposed_ms']:.1f}", f"{s['vs_ring']:.2f}", f"{s['exposed_vs_ring']:.2f}",
                      f"{s['mb_sent_per_rank']:.1f}", str(s["exchanges"]),
                      f"{s['max_error']:.0e} / {s['no_comm_max_error']:.0e}"] for s in size["styles"]]
    return "\n".join(lines + ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
                              *("| " + " | ".join(row) + " |" for row in rows)])


def drive(args) -> None:
    results = []
    for rate in args.rates.split(","):
        out = f"{os.path.splitext(args.json)[0]}_{rate}.json"  # the job's own file, beside the summary
        flags = forward_flags(args, WORKER_FLAGS) + ["--rate", rate, "--json", out]
        launch(os.path.abspath(__file__), args.cp, flags, rate=None if rate == "none" else rate, netem=args.netem)
        results.append(read_json(out))
    print(report(results))
    print(f"results: {write_json(args.json, {'args': vars(args), 'runs': results})}")


if __name__ == "__main__":
    run_harness(parse_args(), worker, drive)
