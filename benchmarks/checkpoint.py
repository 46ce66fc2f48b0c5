"""Checkpoint save and load, side by side: the sharded format on torch.distributed.checkpoint, saved
synchronously and in the background, on one GPT at tp2·pp2·dp2 with ZeRO-1, fp32, gloo on the CPU.

The driver runs this script as one job, which imports the package once and forks 8 ranks; each measures both
saves after one training step (so Adam's moments exist):

- blocking: from the call to the return of ``save``, i.e. until training could go on;
- total: until the checkpoint is published (after ``wait()`` for a background save);
- load: the checkpoint just written, at the same layout;
- peak RSS: the high-water mark of the rank's resident memory during the save, blocking and background
  part (Linux: reset through /proc/self/clear_refs), and how much the save added to the size before it,
  beside the rank's own state (weights, fp32 masters, Adam moments): a sharded save may add that at most.

Times are the slowest rank's; checkpoints go to a temporary folder that is removed at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import replace

from common import MODEL_FLAGS, REPO, RESULTS, add_model_args, format_table, forward_flags, launch, \
    model_overrides, run_harness, write_json

NPROC = 8
LAYOUT = ["parallel.tp=2", "parallel.pp=2", "optimizer.zero_stage=1", "parallel.backend=gloo",
          "parallel.domino=false"]
SMALL = {"hidden": 128, "heads": 4, "layers": 4, "seq": 32, "vocab": 1024, "micro_batch": 1}
MIB = 2**20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=1024, heads=16, layers=12, seq=128, micro_batch=1, vocab=32000)
    parser.add_argument("--small", action="store_true",
                        help="a tiny model that runs in well under a minute (checks the plumbing only)")
    parser.add_argument("--tmp", default=tempfile.gettempdir(), help="where checkpoints are written (removed after)")
    parser.add_argument("--json", default=os.path.join(RESULTS, "checkpoint.json"),
                        help="where the per-rank measurements go (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a job may take (default 1800)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)  # worker: the job's name (log dir, checkpoint dir)
    parser.add_argument("--out", help=argparse.SUPPRESS)  # worker: the JSON file of the measurements
    args = parser.parse_args(argv)
    if args.small:
        for name, value in SMALL.items():
            setattr(args, name, value)
    return args


# ----- worker: a job of 8 forked ranks ----------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])


def _reset_peak() -> int:
    """Restart the high-water mark from the current resident size; returns that size in bytes. Freed heap
    goes back to the system first, or a save could reuse it unseen and its peak would read too low."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc only
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def _own_state_bytes(trainer) -> int:
    weights = sum(p.numel() * p.element_size() for chunk in trainer.chunks for p in chunk.parameters())
    report = trainer.optimizer.memory_report()
    return weights + report["master_bytes"] + report["optimizer_state_bytes"]


def _variants(trainer):
    """'sync' through the trainer's own Checkpointer, 'async' through one with async_save on."""
    from megatron_domino.training.checkpoint import Checkpointer
    cfg = trainer.cfg
    background = Checkpointer(
        replace(cfg, checkpoint=replace(cfg.checkpoint, async_save=True)), trainer.state, trainer.rng, trainer.run_id)
    variants = {}
    for name, checkpointer in (("sync", trainer.checkpointer), ("async", background)):
        save = lambda root, c=checkpointer: c.save(  # noqa: E731
            root, trainer.step, chunks=trainer.chunks, optimizer=trainer.optimizer, lr_schedule=trainer.lr_schedule,
            consumed_samples=0, keep=0)
        load = lambda path, c=checkpointer: c.load(  # noqa: E731
            path, chunks=trainer.chunks, optimizer=trainer.optimizer, lr_schedule=trainer.lr_schedule)
        variants[name] = (save, checkpointer.wait, load)
    return variants


def _measure(save, wait, load, root: str) -> dict:
    """One save into ``root`` and the load of it; ``root`` is removed afterwards."""
    import torch.distributed as dist
    dist.barrier()
    start_rss = _reset_peak()
    began = time.perf_counter()
    path = save(root)
    returned = time.perf_counter()
    wait()
    published = time.perf_counter()
    peak = _status_kib("VmHWM") * 1024
    dist.barrier()
    load_began = time.perf_counter()
    load(path)
    loaded = time.perf_counter()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root)
    return {"blocking_s": returned - began, "total_s": published - began, "load_s": loaded - load_began,
            "peak_bytes": peak, "before_bytes": start_rss}


def _rank(rank: int, args, results) -> None:
    """One rank of the job: a Trainer after one step, then every variant its package has."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(NPROC))
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(args.threads)
        from megatron_domino.config import load_config
        from megatron_domino.training.trainer import Trainer
        ckpt_root = os.path.join(args.tmp, args.name)
        cfg = load_config(os.path.join(REPO, "configs", "tiny", "gpt.yaml"),
                          model_overrides(args, args.name) + LAYOUT + [
                              f"checkpoint.dir={ckpt_root}", f"train.global_batch_size={args.micro_batch * 4}"])
        trainer = Trainer(cfg)
        trainer.train_step()
        trainer.step = 1
        records = []
        for name, (save, wait, load) in _variants(trainer).items():
            root = os.path.join(ckpt_root, f"{len(records)}-{name.split()[0]}")
            records.append({"variant": name, "rank": rank, "own_bytes": _own_state_bytes(trainer),
                            **_measure(save, wait, load, root)})
        trainer.close()
        dist.destroy_process_group()
        results.put((rank, records))
    except BaseException:  # noqa: BLE001 - the parent reports it and ends the job
        results.put((rank, traceback.format_exc()))


def worker(args) -> None:
    """Import the package once, then fork the ranks: 8 interpreters would each pay the import again."""
    import multiprocessing

    import megatron_domino.training.trainer  # noqa: F401 - imported here, inherited by the ranks
    from megatron_domino.parallel.launch import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(rank, args, results), daemon=True) for rank in range(NPROC)]
    for process in ranks:
        process.start()
    records = []
    try:
        for _ in ranks:
            rank, value = results.get(timeout=args.timeout)
            if isinstance(value, str):
                raise SystemExit(f"rank {rank} failed:\n{value}")
            records += value
    finally:
        for process in ranks:
            process.kill()
    shutil.rmtree(os.path.join(args.tmp, args.name), ignore_errors=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(records, f)


# ----- driver -----------------------------------------------------------------------------------
def parameters(args) -> int:
    """The GPT's parameter count: per layer 12h² + 13h, word and position embeddings, the final LayerNorm."""
    h = args.hidden
    return args.layers * (12 * h * h + 13 * h) + (args.vocab + args.seq) * h + 2 * h


def summarize(records: list[dict]) -> list[list]:
    """One row per variant, in the order measured: the slowest rank's times; memory as max / mean over ranks."""
    def spread(values) -> str:
        return f"{max(values) / MIB:.0f} / {sum(values) / len(values) / MIB:.0f}"

    rows = []
    for variant in dict.fromkeys(r["variant"] for r in records):
        ranks = [r for r in records if r["variant"] == variant]
        rows.append([variant, *(f"{max(r[key] for r in ranks):.2f}" for key in ("blocking_s", "total_s", "load_s")),
                     spread([r["peak_bytes"] for r in ranks]),
                     spread([r["peak_bytes"] - r["before_bytes"] for r in ranks]),
                     spread([r["own_bytes"] for r in ranks])])
    return rows


HEADERS = ["save", "blocking s", "total s", "load s", "peak RSS MiB", "added MiB", "own state MiB"]


def drive(args) -> None:
    scratch = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.tmp)
    try:
        out = os.path.join(scratch, "saves.json")
        flags = forward_flags(args, MODEL_FLAGS + ("timeout",)) + ["--tmp", scratch, "--name", "saves", "--out", out]
        launch(os.path.abspath(__file__), 1, flags)
        with open(out, encoding="utf-8") as f:
            records = json.load(f)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\nGPT {parameters(args) / 1e6:.0f}M parameters (hidden {args.hidden}, {args.layers} layers, vocab "
          f"{args.vocab}, seq {args.seq}), fp32, ZeRO-1, tp2·pp2·dp2 on {NPROC} gloo ranks")
    print("times: the slowest rank's; memory per rank, max / mean over ranks: peak RSS during the save, how much "
          "of it the save added,\nand the rank's own state (weights, fp32 masters, Adam moments)\n")
    print(format_table(HEADERS, summarize(records)))
    print(f"\nper-rank measurements: {write_json(args.json, records)}")


if __name__ == "__main__":
    run_harness(parse_args(), worker, drive)
