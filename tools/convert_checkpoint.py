"""Convert checkpoints between Hugging Face and megatron_domino, or between parallel layouts. Offline only.

    python tools/convert_checkpoint.py hf-to-native --model gpt2|llama|mixtral|qwen2|qwen3|qwen3_moe \
        --input HF_DIR --output DIR --tp 2 --pp 2
    python tools/convert_checkpoint.py native-to-hf --input DIR --output HF_DIR [--max-shard-size 5GB]
    python tools/convert_checkpoint.py reshard --input DIR --output DIR2 --tp 1 --pp 4

hf-to-native also writes DIR/config.yaml, so `pretrain_llama.py --config DIR/config.yaml data.path=[PREFIX]`
fine-tunes (or evaluates with --eval-only) from the converted weights.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

import torch  # noqa: E402

from megatron_domino.config import ConfigError  # noqa: E402
from megatron_domino.config.errors import CheckpointError  # noqa: E402
from megatron_domino.convert.convert import hf_to_native, native_to_hf, reshard  # noqa: E402
from megatron_domino.convert.hf_config import MODEL_TYPES  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    to_native = commands.add_parser("hf-to-native", help="HF directory -> native checkpoint + config.yaml")
    to_native.add_argument("--model", choices=MODEL_TYPES,
                           help="expected model type (checked against config.json)")
    to_native.add_argument("--input", required=True, help="local HF directory: config.json and *.safetensors")
    to_native.add_argument("--output", required=True, help="native checkpoint root to create")
    to_native.add_argument("--tp", type=int, default=1)
    to_native.add_argument("--pp", type=int, default=1)
    to_native.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (MoE; taken from data parallel)")
    to_native.add_argument("--seq-length", type=int, help="training sequence length (default: from config.json)")
    to_hf = commands.add_parser("native-to-hf", help="native checkpoint -> HF directory")
    to_hf.add_argument("--input", required=True, help="checkpoint root (follows 'latest') or a step_* directory")
    to_hf.add_argument("--output", required=True, help="HF directory to write")
    to_hf.add_argument("--max-shard-size", default="5GB", help="split weights into files of at most this size")
    to_hf.add_argument("--dtype", choices=tuple(DTYPES), help="cast the weights (default: keep the stored dtype)")
    again = commands.add_parser("reshard", help="native checkpoint -> native checkpoint at another tp/pp")
    again.add_argument("--input", required=True, help="checkpoint root (follows 'latest') or a step_* directory")
    again.add_argument("--output", required=True, help="new checkpoint root")
    again.add_argument("--tp", type=int, required=True)
    again.add_argument("--pp", type=int, required=True)
    again.add_argument("--virtual-pp", type=int, default=1)
    again.add_argument("--ep", type=int, help="expert-parallel ranks (default: the input's)")
    for sub in (to_native, to_hf, again):
        sub.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "hf-to-native":
            out = hf_to_native(args.input, args.output, tp=args.tp, pp=args.pp, model=args.model,
                               seq_length=args.seq_length, quiet=args.quiet, ep=args.ep)
            print(f"wrote {out} and {os.path.join(out, 'config.yaml')}")
        elif args.command == "native-to-hf":
            out = native_to_hf(args.input, args.output, max_shard_size=args.max_shard_size,
                               dtype=DTYPES.get(args.dtype), quiet=args.quiet)
            print(f"wrote {out}")
        else:
            out = reshard(args.input, args.output, tp=args.tp, pp=args.pp, virtual_pp=args.virtual_pp,
                          quiet=args.quiet, ep=args.ep)
            print(f"wrote {out}")
    except (ConfigError, CheckpointError, FileNotFoundError, FileExistsError, ValueError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) else error  # KeyError's str() adds quotes
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
