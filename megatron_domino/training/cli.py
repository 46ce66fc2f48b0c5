"""The command line shared by pretrain_gpt.py and pretrain_llama.py.

    python pretrain_gpt.py --config configs/tiny/gpt.yaml parallel.tp=2 train.steps=20
    torchrun --nproc-per-node 8 pretrain_gpt.py --config ...      (srun works the same way)

The config is loaded and validated for the launched world size before any process group
exists; a bad setting exits with status 2 and a message naming the key, the value, the rule and
a fix. A failing rank prints its error once, prefixed with its coordinates, and exits non-zero
(torchrun and srun --kill-on-bad-exit then stop the others).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings

from ..config import ConfigError, load_config, validate_config


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)


def parse_args(argv, family: str):
    parser = argparse.ArgumentParser(description=f"Pretrain a {family} model with megatron_domino.")
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--eval-only", action="store_true", help="load checkpoint.load and evaluate the validation split")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate, print the rank map and memory estimate; start no process group")
    parser.add_argument("--world-size", type=int, default=None, help="world size for --dry-run (default: launcher's)")
    parser.add_argument("--print-schedule", action="store_true", help="print the pipeline schedule timeline and exit")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. parallel.tp=2")
    return parser.parse_intermixed_args(argv)


def main(argv=None, family: str = "GPT") -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv, family)
    world = args.world_size or _world_size()
    try:
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            from .dry_run import dry_run
            print(dry_run(cfg, world))
            return 0
        check_paths = not (cfg.data.mock or args.print_schedule)  # printing a schedule reads no files
        for message in validate_config(cfg, world_size=world, check_paths=check_paths):
            warnings.warn(message, stacklevel=1)
        if args.eval_only and not cfg.checkpoint.load:
            raise ConfigError("checkpoint.load", None, "--eval-only needs a checkpoint to evaluate",
                              "pass checkpoint.load=DIR or checkpoint.load=auto")
    except (ConfigError, FileNotFoundError) as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    if args.print_schedule:
        from ..pipeline.print_schedule import main as print_schedule
        par, train = cfg.parallel, cfg.train
        micro = train.global_batch_size // (train.micro_batch_size * (par.dp or world // (par.tp * par.pp)))
        kind = "none" if par.pp == 1 else "interleaved" if par.virtual_pp > 1 else "1f1b"
        return print_schedule(["--pp", str(par.pp), "--microbatches", str(micro), "--virtual", str(par.virtual_pp),
                               "--kind", kind])
    from .trainer import run
    try:
        run(cfg, eval_only=args.eval_only)
    except BaseException as error:  # noqa: BLE001 - reported once with coordinates, then a non-zero exit
        if isinstance(error, SystemExit) and not error.code:
            raise
        _report_failure(error)
        sys.stderr.flush()
        os._exit(1)  # never hang in teardown on a dead peer
    return 0


_PEER_FAILURE_HINTS = ("connection closed", "connection reset", "timed out", "broken pipe", "peer")


def _report_failure(error: BaseException) -> None:
    """The failing rank's traceback once, prefixed with its coordinates; ranks that merely lost a peer say one line."""
    from ..parallel import state
    where = state.get().coordinates() if state.is_initialized() else f"rank {os.environ.get('RANK', '0')}"
    message = str(error).lower()
    if isinstance(error, RuntimeError) and any(hint in message for hint in _PEER_FAILURE_HINTS):
        print(f"[{where}] stopped: a peer failed ({type(error).__name__}: {str(error).splitlines()[0][:200]})",
              file=sys.stderr, flush=True)
        return
    lines = traceback.format_exc().rstrip().splitlines()
    print("\n".join(f"[{where}] {line}" for line in lines), file=sys.stderr, flush=True)
