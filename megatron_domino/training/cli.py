"""The command line shared by pretrain_gpt.py and pretrain_llama.py.

    python pretrain_gpt.py --config configs/tiny/gpt.yaml parallel.tp=2 train.steps=20
    torchrun --nproc-per-node 8 pretrain_gpt.py --config ...      (srun works the same way)

The config is loaded and validated for the launched world size before any process group
exists; a bad setting exits with status 2 and a message naming the key, the value, the rule and
a fix. A run that fails later exits with status 1 (torchrun and srun --kill-on-bad-exit then stop
the others). A known error (``config.errors.KnownError``: bad config, data or checkpoint; a store
barrier that timed out) prints one short block, what and where and the fix, from the first rank to
report it; the other ranks say one line naming that rank. Any other error is a bug and keeps its
traceback. Either way each failing rank writes its full traceback to ``<log.dir>/error-rank<R>.log``.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings

from ..config import ConfigError, load_config
from ..validation import validate_config
from ..parallel.launch import device_type_for, launched_rank, launched_world_size
from ..parallel.topology import Topology
from .signals import remember_early_warnings


def parse_args(argv, family: str):
    parser = argparse.ArgumentParser(description=f"Pretrain a {family} model with megatron_domino.")
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--eval-only", action="store_true",
                        help="load checkpoint.load and evaluate the validation split")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate, print the rank map and memory estimate; start no process group")
    parser.add_argument("--world-size", type=int, default=None, help="world size for --dry-run (default: launcher's)")
    parser.add_argument("--print-schedule", action="store_true", help="print the pipeline schedule timeline and exit")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. parallel.tp=2")
    return parser.parse_intermixed_args(argv)


def main(argv=None, family: str = "GPT") -> int:
    early = remember_early_warnings()
    args = parse_args(sys.argv[1:] if argv is None else argv, family)
    world = args.world_size or launched_world_size() or 1
    try:
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            from .dry_run import dry_run
            print(dry_run(cfg, world))
            return 0
        check_paths = not (cfg.data.mock or args.print_schedule)  # printing a schedule reads no files
        device_type = device_type_for(cfg.parallel.backend)
        for message in validate_config(cfg, world_size=world, check_paths=check_paths, device_type=device_type):
            warnings.warn(message, stacklevel=1)
        if args.eval_only and not cfg.checkpoint.load:
            raise ConfigError("checkpoint.load", None, "--eval-only needs a checkpoint to evaluate",
                              "pass checkpoint.load=DIR or checkpoint.load=auto")
    except (ConfigError, FileNotFoundError) as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    if args.print_schedule:  # the run's own schedule: its kind, and micro-batches per DP rank as the trainer counts
        from ..pipeline.timeline import show_run
        return show_run(cfg.parallel, cfg.train.num_microbatches(Topology.from_config(cfg.parallel, world).dp))
    from .run import run
    try:
        run(cfg, eval_only=args.eval_only, early=early)
    except BaseException as error:  # noqa: BLE001 - reported once with coordinates, then a non-zero exit
        if isinstance(error, SystemExit) and not error.code:
            raise
        status = _report_failure(error, cfg)
        sys.stderr.flush()
        os._exit(status)  # never hang in teardown on a dead peer
    return 0


_PEER_FAILURE_HINTS = ("connection closed", "connection reset", "timed out", "broken pipe", "peer")
_FIRST_REPORT_KEY = "megatron_domino/first_failure"


def _report_failure(error: BaseException, cfg) -> int:
    """Print ``error`` for a person and return the exit status. Never raises: an error in the reporter would
    replace the one it reports, so it falls back to the plain traceback."""
    try:
        return _report(error, cfg)
    except BaseException:  # noqa: BLE001
        traceback.print_exception(error)
        return 1


def _report(error: BaseException, cfg) -> int:
    """Ctrl-C and a lost peer: one line. A bug: its traceback. A known error: the block, from the first rank."""
    from ..config.errors import KnownError
    from ..parallel.store_barrier import StoreBarrierTimeout
    from .signals import INTERRUPTED
    log_dir = cfg.log.dir
    rank, where = _rank_and_coordinates(cfg.parallel)
    if isinstance(error, KeyboardInterrupt):
        _say(f"[{where}] interrupted (Ctrl-C) outside the training steps: exiting without saving")
        return INTERRUPTED
    message = str(error)
    if isinstance(error, RuntimeError) and any(hint in message.lower() for hint in _PEER_FAILURE_HINTS):
        _say(f"[{where}] stopped: a peer failed ({type(error).__name__}: {message[:200].splitlines()[0]})")
        return 1
    log = _write_traceback(error, os.path.join(log_dir, f"error-rank{rank}.log"))
    if not isinstance(error, (KnownError, StoreBarrierTimeout)):
        lines = "".join(traceback.format_exception(error)).rstrip().splitlines() + [f"(also in {log})"]
        _say("\n".join(f"[{where}] {line}" for line in lines))
        return 1
    first = _first_to_report(where)
    if first != where:
        _say(f"[{where}] stopped: {first} failed first and reported why ({type(error).__name__} here too; "
             f"traceback in {log})")
        return 1
    lines = message.replace(". Fix: ", ".\nFix: ").splitlines() or [""]
    _say("\n".join([f"[{where}] {type(error).__name__}: {lines[0]}", *(f"  {line}" for line in lines[1:]),
                    f"  (full traceback: {log})"]))
    return 1


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _rank_and_coordinates(par) -> tuple[int, str]:
    """This rank and its coordinates ('rank 5 (tp 1, pp 1, dp 0)'), from as far as start-up got."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return launched_rank(), f"rank {launched_rank()}"
    rank = dist.get_rank()
    try:
        return rank, Topology.from_config(par, dist.get_world_size()).describe(rank)
    except ValueError:  # the layout does not fit the world: name the rank alone
        return rank, f"rank {rank}"


def _write_traceback(error: BaseException, path: str) -> str:
    """Write the full traceback to ``path``; returns what to tell the reader about where it is."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(traceback.format_exception(error)))
        return path
    except OSError as problem:
        return f"nowhere: {path} could not be written ({problem.strerror})"


def _first_to_report(where: str) -> str:
    """The coordinates of the first rank to report a known error. Ranks often fail together (every rank
    reads the same bad file), so the first to claim a key in the launcher's store prints the block and the
    others name it. Without a store (one process, or its host has gone) every rank counts as first."""
    try:
        import torch.distributed as dist
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return where
        store = dist.distributed_c10d._get_default_store()
        return store.compare_set(_FIRST_REPORT_KEY, "", where).decode()
    except Exception:  # noqa: BLE001 - no store: report here
        return where
