"""Tokenize a JSONL corpus into Megatron's .bin/.idx format. Flag names are Megatron-LM's, so recipes carry over.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --json-keys text --append-eod --workers 8

writes data/corpus_text_document.bin/.idx. Use --partitions N on large inputs to make the run resumable.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_domino.config.schema import TokenizerConfig  # noqa: E402
from megatron_domino.data.preprocessing import (  # noqa: E402
    PreprocessOptions,
    output_prefix,
    preprocess,
    write_bad_line_report,
)
from megatron_domino.data.tokenizer import TOKENIZER_TYPES  # noqa: E402

_BAD_LINES_SHOWN = 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL file, one document per line")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_<key>_document.bin/.idx")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize, each into its own dataset")
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    p.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    p.add_argument("--tokenizer-model", help="SentencePiece .model, or HF tokenizer directory / tokenizer.json")
    p.add_argument("--vocab-size", type=int, help="NullTokenizer: vocabulary size (EOD is vocab_size - 1)")
    p.add_argument("--append-eod", action="store_true", help="end every document with the tokenizer's EOD id")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--partitions", type=int, default=1,
                   help="cut the input into this many ranges, each kept when done, so a rerun resumes")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    options = PreprocessOptions(
        input=args.input, output_prefix=args.output_prefix,
        tokenizer=TokenizerConfig(type=args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                                  model=args.tokenizer_model),
        vocab_size=args.vocab_size, json_keys=tuple(args.json_keys), append_eod=args.append_eod,
        workers=args.workers, partitions=args.partitions)
    stats = preprocess(options)
    print(stats.summary())
    for key in options.json_keys:
        print(f"wrote {output_prefix(options.output_prefix, key)}.bin/.idx")
    if stats.bad_count:
        report = options.output_prefix + "_bad_lines.txt"
        write_bad_line_report(stats, report)
        print(f"{stats.bad_count:,} bad lines skipped; first ones:", file=sys.stderr)
        for line_no, reason in stats.bad_lines[:_BAD_LINES_SHOWN]:
            print(f"  line {line_no}: {reason}", file=sys.stderr)
        print(f"all of them: {report}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
